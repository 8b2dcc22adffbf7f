"""SQLStore: what the SQLite and PostgreSQL stores (store/sqlite.py, store/postgres.py) share.

The same tables and columns, lists and dicts as JSON text, the same argument checks, and every
query whose logic does not depend on the database: record reads, the version registry and the
event log, written once with `?` placeholders and `{t}` before table names. A subclass names its
dialect (PLACEHOLDER, TABLE_PREFIX, INSERT_ORDER) and gives `_read(sql, args)` (rows),
`_write()` (a transaction yielding a connection with `execute`) and `_lock_registry(db)`; what is
the database's own (bounds, feedback's concurrency, migrations, stats) stays in the subclass.

    db.executemany(f"INSERT ... ({RECORD_COLS}) VALUES (...)", [record_row(r) for r in records])
"""

from __future__ import annotations

import abc
import json
import math
import time
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import orjson

from store.types import VERSION_STATUSES, FeedbackConflict, FeedbackStore, Labeled, Record

RECORD_COLS = ("id, created, server, version, prompt, prompt_ids, completion_ids, text, finish_reason, trace, "
               "sampling")
# a feedback row joined with its record (`feedback f JOIN records r`), as labeled_of reads it
LABELED_COLS = ", ".join(f"r.{c.strip()}" for c in RECORD_COLS.split(",")) + ", f.reward, f.label, f.time, f.seq"
VERSION_COLS = "version, parent, step, run_id, data, eval, status, created, updated"
EVENT_COLS = "id, time, kind, version, replica, detail"


def record_row(r: Record) -> tuple:
    return (r.id, float(r.created), r.server, int(r.version), r.prompt, json_text(list(r.prompt_ids)),
            json_text(list(r.completion_ids)), r.text, r.finish_reason, json_text(r.trace), json_text(r.sampling))


def json_text(obj: Any) -> str:
    """`obj` as JSON text, as json.dumps reads it back: orjson (the recorder writes a few records per
    request, and json.dumps was a third of that), json.dumps where orjson would differ -- a non-finite
    float (orjson writes null, json keeps NaN/Infinity) or a type orjson refuses."""
    if _finite(obj):
        try:
            return orjson.dumps(obj).decode()
        except TypeError:  # orjson.JSONEncodeError: a type or an int orjson does not take
            pass
    return json.dumps(obj)


def _finite(v: Any) -> bool:
    """No float in `v` is NaN or infinite (a list of numbers in one C-level sum: NaN and inf survive it;
    a huge finite sum that overflows only sends `v` to json.dumps, which is always right)."""
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        try:
            return math.isfinite(sum(v))
        except (TypeError, OverflowError):  # not all numbers, or an int too large for a float
            return all(_finite(x) for x in v)
    return True


def record_of(row: tuple) -> Record:
    return Record(id=row[0], created=row[1], server=row[2], version=row[3], prompt=row[4],
                  prompt_ids=json.loads(row[5]), completion_ids=json.loads(row[6]), text=row[7],
                  finish_reason=row[8], trace=json.loads(row[9]), sampling=json.loads(row[10]))


def labeled_of(row: tuple) -> Labeled:
    return Labeled(record=record_of(row[:11]), reward=row[11], label=row[12], feedback_time=row[13], seq=row[14])


def version_row(version: int, parent: int | None, step: int, run_id: str, data: dict, now: float) -> tuple:
    """(version, parent, step, run_id, data, created, updated) of register_version."""
    return (int(version), None if parent is None else int(parent), int(step), str(run_id), json.dumps(data or {}),
            now, now)


def version_of(r: tuple) -> dict:
    return {"version": r[0], "parent": r[1], "step": r[2], "run_id": r[3], "data": json.loads(r[4]),
            "eval": None if r[5] is None else json.loads(r[5]), "status": r[6], "created": r[7], "updated": r[8]}


def event_of(r: tuple) -> dict:
    return {"id": r[0], "time": r[1], "kind": r[2], "version": r[3], "replica": r[4], "detail": json.loads(r[5])}


def finite_reward(reward: float) -> float:
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"reward: must be a finite number, got {reward}")
    return reward


def check_status(status: str | None) -> None:
    if status is not None and status not in VERSION_STATUSES:
        raise ValueError(f"status: must be one of {', '.join(VERSION_STATUSES)}, got {status!r}")


class SQLStore(FeedbackStore):
    """The queries both SQL stores run the same way (see the module docstring)."""

    PLACEHOLDER = "?"       # "%s" on PostgreSQL
    TABLE_PREFIX = ""       # "dlrl_" on PostgreSQL (a shared database)
    INSERT_ORDER = "rowid"  # the records' insertion order among equal `created` ("rseq" on PostgreSQL)
    HOLD_RECORD = ""        # " FOR SHARE" on PostgreSQL: a record cannot be deleted (bound, prune) while
                            # feedback on it commits (SQLite's one writer at a time already ensures it)
    MAX_ONE_STATEMENT: ClassVar[int]  # rows a batch may hold to go in as one statement (`_insert_if_fits`)
    prune_every_s: float  # prune() again once this long has passed since the last one, as writers add
    _last_prune: float  # time.monotonic() of the last prune()

    @abc.abstractmethod
    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        """All rows of one query, in the database's own dialect."""

    def add_records(self, records: list[Record]) -> None:
        """Insert, keeping the bounds: a batch of up to MAX_ONE_STATEMENT rows in one statement when it fits
        under max_records, else in one transaction that also deletes the oldest; prune when it is time."""
        rows = [record_row(r) for r in records]
        if not rows:
            return
        if len(rows) > self.MAX_ONE_STATEMENT or not self._insert_if_fits(rows):
            self._insert_bounded(rows)
        if time.monotonic() - self._last_prune >= self.prune_every_s:
            self.prune()

    @abc.abstractmethod
    def _insert_if_fits(self, rows: list[tuple]) -> bool:
        """The common case in one autocommit statement: True when written, False when nothing was inserted
        (the batch would pass max_records) and `_insert_bounded` decides."""

    @abc.abstractmethod
    def _insert_bounded(self, rows: list[tuple]) -> None:
        """Insert in one transaction that also deletes the oldest records beyond max_records."""

    @abc.abstractmethod
    def _write(self) -> AbstractContextManager[Any]:
        """One write transaction: committed when the block ends, rolled back on an exception."""

    def _lock_feedback(self, db: Any) -> None:
        """Serialise feedback writers inside `db`'s transaction, so that `seq` follows commit order
        (SQLite's write transaction already does)."""

    def _lock_registry(self, db: Any) -> None:
        """Serialise registry and event writers inside `db`'s transaction (SQLite's write
        transaction already does)."""

    def _sql(self, sql: str) -> str:
        return sql.replace("{t}", self.TABLE_PREFIX).replace("?", self.PLACEHOLDER)

    def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self._read(self._sql(sql), args)

    # -- records and feedback ---------------------------------------------------------------
    def add_record(self, record: Record) -> None:
        self.add_records([record])  # the subclass's batch insert, which keeps the bounds

    def add_feedback(self, record_id: str, reward: float, label: str | None = None) -> bool:
        reward = finite_reward(reward)
        with self._write() as db:
            self._lock_feedback(db)
            if db.execute(self._sql(f"SELECT 1 FROM {{t}}records WHERE id = ?{self.HOLD_RECORD}"),
                          (record_id,)).fetchone() is None:
                raise KeyError(record_id)
            old = db.execute(self._sql("SELECT reward FROM {t}feedback WHERE record_id = ?"), (record_id,)).fetchone()
            if old is not None:
                if old[0] != reward:
                    raise FeedbackConflict(f"record {record_id} already has reward {old[0]}, not {reward}")
                return False
            db.execute(self._sql("INSERT INTO {t}feedback (record_id, reward, label, time) VALUES (?,?,?,?)"),
                       (record_id, reward, label, time.time()))
            return True

    def get_record(self, record_id: str) -> Record | None:
        rows = self._q(f"SELECT {RECORD_COLS} FROM {{t}}records WHERE id = ?", (record_id,))
        return record_of(rows[0]) if rows else None

    def labeled(self, after_seq: int = 0, min_version: int = 0, limit: int = 1000) -> list[Labeled]:
        rows = self._q(f"SELECT {LABELED_COLS} FROM {{t}}feedback f JOIN {{t}}records r ON r.id = f.record_id "
                       "WHERE f.seq > ? AND r.version >= ? ORDER BY f.seq LIMIT ?",
                       (int(after_seq), int(min_version), int(limit)))
        return [labeled_of(row) for row in rows]

    def prompts(self, after: float = 0.0, limit: int = 1000) -> list[Record]:
        rows = self._q(f"SELECT {RECORD_COLS} FROM {{t}}records WHERE created > ? "
                       f"ORDER BY created, {self.INSERT_ORDER} LIMIT ?", (float(after), int(limit)))
        return [record_of(row) for row in rows]

    # -- version registry and events --------------------------------------------------------
    def register_version(self, version: int, parent: int | None, step: int, run_id: str,
                         data: dict) -> None:
        with self._write() as db:
            db.execute(self._sql(
                "INSERT INTO {t}versions (version, parent, step, run_id, data, status, created, updated) "
                "VALUES (?,?,?,?,?,'trained',?,?) ON CONFLICT (version) DO UPDATE SET parent = excluded.parent, "
                "step = excluded.step, run_id = excluded.run_id, data = excluded.data, updated = excluded.updated"),
                version_row(version, parent, step, run_id, data, time.time()))

    def update_version(self, version: int, *, eval: dict | None = None, status: str | None = None) -> None:
        check_status(status)
        with self._write() as db:
            self._lock_registry(db)
            if db.execute(self._sql("SELECT 1 FROM {t}versions WHERE version = ?"), (int(version),)).fetchone() is None:
                raise KeyError(f"version {version} is not registered")
            if eval is not None:
                db.execute(self._sql("UPDATE {t}versions SET eval = ?, updated = ? WHERE version = ?"),
                           (json.dumps(eval), time.time(), int(version)))
            if status is not None:
                db.execute(self._sql("UPDATE {t}versions SET status = ?, updated = ?, status_order = "
                                     "(SELECT COALESCE(MAX(status_order), 0) + 1 FROM {t}versions) WHERE version = ?"),
                           (status, time.time(), int(version)))

    def log_event(self, kind: str, version: int, replica: str | None = None,
                  detail: dict | None = None) -> None:
        with self._write() as db:
            self._lock_registry(db)
            db.execute(self._sql("INSERT INTO {t}events (time, kind, version, replica, detail) VALUES (?,?,?,?,?)"),
                       (time.time(), str(kind), int(version), replica, json.dumps(detail or {})))

    def versions(self) -> list[dict]:
        return [version_of(r) for r in self._q(f"SELECT {VERSION_COLS} FROM {{t}}versions ORDER BY version")]

    def events(self, after_id: int = 0) -> list[dict]:
        return [event_of(r) for r in self._q(f"SELECT {EVENT_COLS} FROM {{t}}events WHERE id > ? ORDER BY id",
                                             (int(after_id),))]

    def serving_version(self) -> int | None:
        rows = self._q("SELECT version FROM {t}versions WHERE status = 'serving' ORDER BY status_order DESC LIMIT 1")
        return rows[0][0] if rows else None
