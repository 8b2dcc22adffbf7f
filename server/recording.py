"""Recording served samples into the feedback store, off the event loop (issue 19).

    recorder = Recorder.from_config(config, engine, metrics)      # server.app does it; None = no store
    record_id = recorder.record_one(seq, prompt_text)   # its record_id, or None when not recorded
    recorder.add_feedback(record_id, 1.0, "accept")               # in a worker thread (routes_feedback)

`server.record` says which samples are recorded: `none`, `sample` (each finished sample
with probability `server.record_fraction`) or `all`. Aborted samples are never recorded
(they were cut short by the server or the client, not ended by the policy). A recorded
sample gets its id at once and is written by one background thread through a bounded
queue: recording never blocks or fails a request. A full queue drops the record and a
failed write is logged; both count in `dlrl_store_errors_total`. Feedback for a record
that is still queued writes that record first, so an id is usable as soon as it is returned.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import sqlite3
import threading
import time
from typing import Any

from dllm.configlib import ConfigError
from store import FeedbackStore, Record, new_record_id, open_store

log = logging.getLogger("dlrl.server")
MODES = ("none", "sample", "all")
_STOP = object()


class Recorder:
    def __init__(self, store: FeedbackStore, *, mode: str = "none", fraction: float = 0.1, server: str = "",
                 metrics: Any = None, max_pending: int = 10_000, seed: int | None = None):
        if mode not in MODES:
            raise ValueError(f"server.record: must be one of {MODES}, got {mode!r}")
        self.store, self.mode, self.fraction, self.server = store, mode, float(fraction), server
        self.metrics = metrics
        self._rng = random.Random(seed)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._pending: dict[str, Record] = {}  # queued, not yet written
        self._lock = threading.Lock()
        self._num_errors = 0
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="dlrl-recorder")
        self._writer.start()

    @classmethod
    def from_config(cls, config: Any, engine: Any, metrics: Any = None) -> Recorder | None:
        """The app's recorder: None when neither recording nor feedback needs the store."""
        if config.record == "none" and not config.resolved_feedback_token():
            return None
        try:
            store = open_store(config.store, max_records=config.store_max_records,
                               max_age_s=config.store_max_age_s)
        except (sqlite3.Error, OSError) as e:
            raise ConfigError(f"server.store: cannot open the feedback store {config.store!r}: {e}") from None
        server = f"http://{config.host}:{config.port}"
        log.info("feedback store %s (record=%s%s)", config.store, config.record,
                 f", fraction {config.record_fraction}" if config.record == "sample" else "")
        return cls(store, mode=config.record, fraction=config.record_fraction, server=server, metrics=metrics)

    # -------------------------------------------------------------- request side (event loop)
    def is_chosen(self) -> bool:
        if self.mode == "all":
            return True
        return self.mode == "sample" and self._rng.random() < self.fraction

    def record_one(self, seq: Any, prompt: str | None = None) -> str | None:
        if seq.finish_reason == "abort" or not self.is_chosen():
            return None
        try:
            rec = self._to_record(seq, prompt)
            with self._lock:
                self._queue.put_nowait(rec)
                self._pending[rec.id] = rec
        except queue.Full:
            self.report_error("recording queue full (the store cannot keep up): record dropped")
            return None
        except Exception as e:  # a record that cannot be built must not fail the request
            self.report_error(f"cannot record a sample: {type(e).__name__}: {e}")
            return None
        return rec.id

    def _to_record(self, seq: Any, prompt: str | None) -> Record:
        trace = {**seq.trace.to_dict(), "finish_reason": seq.finish_reason}
        return Record(id=new_record_id(), created=time.time(), server=self.server, version=int(seq.trace.version),
                      prompt=prompt, prompt_ids=list(seq.prompt_ids), completion_ids=list(seq.completion_ids),
                      text=seq.text, finish_reason=seq.finish_reason, trace=trace,
                      sampling=dataclasses.asdict(seq.params))

    # -------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        while True:
            rec = self._queue.get()
            if rec is _STOP:
                return
            self._write(rec)

    def _write(self, rec: Record) -> bool:
        try:
            self.store.add_record(rec)
        except Exception as e:
            self.report_error(f"store write failed: {type(e).__name__}: {e}")
            return False
        finally:
            with self._lock:
                self._pending.pop(rec.id, None)
        if self.metrics is not None:
            self.metrics.records.inc()
        return True

    def report_error(self, message: str) -> None:
        self._num_errors += 1
        if self.metrics is not None:
            self.metrics.store_errors.inc()
        if self._num_errors <= 10 or self._num_errors % 1000 == 0:
            log.error("%s (store errors so far: %d)", message, self._num_errors)

    # -------------------------------------------------------------- feedback (worker thread)
    def add_feedback(self, record_id: str, reward: float, label: str | None = None) -> bool:
        """store.add_feedback, writing the record first when it is still queued (KeyError,
        FeedbackConflict as the store raises them)."""
        with self._lock:
            rec = self._pending.get(record_id)
        if rec is not None:
            self.store.add_record(rec)  # idempotent: the writer thread may write it again
        return self.store.add_feedback(record_id, reward, label)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued record is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._queue.put(_STOP)
        self._writer.join(timeout=5)
        self.store.close()



def record_ids(state: Any, seqs: list[Any], prompts: list[Any] | None = None, n: int = 1) -> list[str | None]:
    """The record_id of each finished sequence of a request (prompt-major, n per prompt; all
    None when the server records nothing). Text prompts are stored; token-id prompts as None."""
    return [record_one(state, seq, prompts[i // n] if prompts else None) for i, seq in enumerate(seqs)]


def record_one(state: Any, seq: Any, prompt: Any = None) -> str | None:
    recorder = getattr(state, "recorder", None)
    if recorder is None or recorder.mode == "none":
        return None
    return recorder.record_one(seq, prompt if isinstance(prompt, str) else None)
