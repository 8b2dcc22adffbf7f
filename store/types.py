"""The feedback store's data types and its small interface (stdlib only).

`Record` is one served sample exactly as the engine produced it (ids, trace, version),
`Labeled` a record with the reward a user gave it. `FeedbackStore` is the interface the
server (recording, `/v1/feedback`) and `dlrl align` (training data, version registry,
events) use; `store.sqlite.SQLiteStore` implements it on one SQLite file. A fleet swaps
in another implementation of the same methods (see README, "Continuous alignment").

    rec = Record(id=new_record_id(), created=time.time(), server="tiny-sft", version=3,
                 prompt="1+2=", prompt_ids=[...], completion_ids=[...], text="3",
                 finish_reason="stop", trace={...}, sampling={"temperature": 1.0, ...})
"""

from __future__ import annotations

import abc
import os
import threading
from dataclasses import asdict, dataclass, field

# Version statuses of the registry, in the order a version usually goes through them.
VERSION_STATUSES = ("trained", "candidate", "gated_out", "canary", "serving", "rolled_back", "retired",
                    "superseded")


def new_record_id() -> str:
    """A fresh record id (`rec-` + 24 hex digits): unguessable, so an id is a capability to
    give feedback on that one sample and nothing else. 96 bits of os.urandom, drawn 256 ids at a
    time (one getrandom call, not one per id on a busy event loop); a forked child draws its own."""
    global _id_pos, _id_bytes
    with _id_lock:
        if _id_pos + 12 > len(_id_bytes):
            _id_bytes, _id_pos = os.urandom(12 * 256), 0
        raw, _id_pos = _id_bytes[_id_pos:_id_pos + 12], _id_pos + 12
    return "rec-" + raw.hex()


_id_lock = threading.Lock()
_id_bytes, _id_pos = b"", 0


def _forget_ids() -> None:  # in a forked child: never hand out the ids its parent may hand out
    global _id_bytes, _id_pos, _id_lock
    _id_bytes, _id_pos, _id_lock = b"", 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_ids)


ERROR_CAUSES = ("disk_full", "io_error", "unavailable", "locked", "refused", "error")


def error_cause(exc: BaseException) -> str:
    """A store failure's cause as a short label (metrics, logs): `disk_full` (SQLite "database
    or disk is full", ENOSPC, PostgreSQL class 53), `io_error` (SQLite "disk I/O error", EIO,
    EFBIG: a file-size limit), `unavailable` (cannot reach or open the database), `locked`
    (busy/lock timeout), `refused` (the store cannot hold this data: a PostgreSQL data exception,
    class 22, such as NUL in text; a DataError; a string that is not valid Unicode: the data's
    fault, not the store's), else `error`."""
    import errno

    text = str(exc).lower()
    sqlstate = getattr(exc, "sqlstate", None) or ""
    if (getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in text
            or "no space left" in text or sqlstate.startswith("53")):
        return "disk_full"
    if getattr(exc, "errno", None) in (errno.EIO, errno.EFBIG) or "disk i/o error" in text or sqlstate == "58030":
        return "io_error"
    if "locked" in text or "busy" in text or sqlstate in ("55P03", "40P01"):
        return "locked"
    if (sqlstate.startswith(("08", "57P")) or "unable to open" in text or "connection" in text
            or type(exc).__name__ == "PoolTimeout"):
        return "unavailable"
    if sqlstate.startswith("22") or type(exc).__name__ == "DataError" or isinstance(exc, UnicodeError):
        return "refused"
    return "error"


class FeedbackConflict(ValueError):
    """Feedback with a different reward for a record that already has feedback (HTTP 409)."""


@dataclass
class Record:
    """One served sample, exactly as the engine produced it."""

    id: str                       # unique; returned to the client as `record_id`
    created: float                # unix time
    server: str                   # the replica that served it (served_model_name or URL)
    version: int                  # weight version that generated the WHOLE sample
    prompt: str | None            # text prompt (None when the client sent ids)
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "stop"
    trace: dict = field(default_factory=dict)     # dllm.trace.Trace fields
    sampling: dict = field(default_factory=dict)  # temperature, top_k, top_p, strategy, steps, ...

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Labeled:
    """A record with its feedback; `seq` is the store's monotonically increasing feedback cursor."""

    record: Record
    reward: float
    label: str | None
    feedback_time: float
    seq: int


class FeedbackStore(abc.ABC):
    """Records, feedback, the version registry and the event log behind one small interface.

    Every method is safe to call from several threads and, for implementations that say so
    (SQLiteStore), from several processes at once. Bounds (max records, max age) are options
    of the implementation; writers call `prune()` (SQLiteStore also enforces them as it writes).
    """

    @abc.abstractmethod
    def add_record(self, record: Record) -> None:
        """Store a served sample; idempotent on `record.id` (a second add is ignored)."""

    def add_records(self, records: list[Record]) -> None:
        """Store several records in one transaction where the implementation can (the
        recorder's batched writes); all or none. Default: one add_record each."""
        for record in records:
            self.add_record(record)

    @abc.abstractmethod
    def add_feedback(self, record_id: str, reward: float, label: str | None = None) -> bool:
        """Attach a reward: True if new, False if the same reward was already there.
        Raises KeyError for an unknown id, FeedbackConflict (a ValueError) for a different
        reward on a record that already has feedback, ValueError for a non-finite reward."""

    @abc.abstractmethod
    def get_record(self, record_id: str) -> Record | None:
        """The record with this id, or None."""

    @abc.abstractmethod
    def labeled(self, after_seq: int = 0, min_version: int = 0, limit: int = 1000) -> list[Labeled]:
        """Feedback in arrival order with seq > after_seq; records of versions < min_version skipped."""

    @abc.abstractmethod
    def prompts(self, after: float = 0.0, limit: int = 1000) -> list[Record]:
        """Records created after `after` (unix time), oldest first: tail it with after=last.created."""

    @abc.abstractmethod
    def register_version(self, version: int, parent: int | None, step: int, run_id: str,
                         data: dict) -> None:
        """Add a version to the registry (status `trained`); registering it again updates
        parent/step/run_id/data and keeps its status and eval."""

    @abc.abstractmethod
    def update_version(self, version: int, *, eval: dict | None = None, status: str | None = None) -> None:
        """Set a registered version's eval scores and/or status (one of VERSION_STATUSES).
        Raises KeyError for an unregistered version, ValueError for an unknown status."""

    @abc.abstractmethod
    def log_event(self, kind: str, version: int, replica: str | None = None,
                  detail: dict | None = None) -> None:
        """Append an event (promotion_started, canary, promoted, gate_failed, rollback,
        replica_synced, ...): a log for people and metrics; the registry holds the state."""

    @abc.abstractmethod
    def versions(self) -> list[dict]:
        """The registry, by version: {version, parent, step, run_id, data, eval, status, created, updated}."""

    @abc.abstractmethod
    def events(self, after_id: int = 0) -> list[dict]:
        """Events with id > after_id, in order: {id, time, kind, version, replica, detail}."""

    @abc.abstractmethod
    def serving_version(self) -> int | None:
        """The last fully promoted version: the version most recently set to status `serving`
        (promotion: update_version(v, status="serving"); rollback to u: the bad version to
        `rolled_back`, u to `serving` again), or None before the first promotion."""

    @abc.abstractmethod
    def prune(self) -> int:
        """Enforce the bounds (max records, max age); returns the number of records removed."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Counts, bytes on disk, oldest/newest record time, bounds."""

    def close(self) -> None:  # noqa: B027 - optional for implementations without resources
        """Release connections (optional)."""

    def __enter__(self) -> FeedbackStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
