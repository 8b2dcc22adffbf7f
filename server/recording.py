"""Recording served samples into the feedback store: written before the id is handed out.

    recorder = Recorder.from_config(config, engine, metrics)   # server.app does it; None = no store
    ids = await recorder.record([(seq, prompt), ...])          # record_id per sample, or None
    recorder.add_feedback(record_id, 1.0, "accept")            # in a worker thread (routes_feedback)

`server.record` says which samples are recorded: `none`, `sample` (each finished sample
with probability `server.record_fraction`) or `all`. Aborted samples are never recorded.

An id returned to a client is always valid. A request's records go through a bounded queue
(`server.record_max_pending` records) to one writer thread, which writes whatever is queued
in ONE transaction (batched across concurrent requests, off the event loop); the request
awaits that commit, at most `server.record_wait_s`, and only then answers with the ids.
What is not written by then is answered with `record_id: null` (counted in
`dlrl_record_ids_withheld_total{reason}`) and still written when it can be. While the store
is failing (full disk, database down) requests do not wait at all: records stay queued and
are retried with backoff until the store returns; when the queue is full the newest are
dropped (`dlrl_records_dropped_total{reason="queue_full"}`), a record the store refuses for
another reason is dropped too (`reason="error"`), and failures are logged by cause
(server/store_health.py). Recording never fails a request.

A crash (SIGKILL, power cut) loses only records whose ids were never returned: the ones
still queued, and with SQLite's `synchronous=NORMAL` a power cut (not a process crash) may
lose the last commits. Feedback is acknowledged only after its commit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any

from dllm.configlib import ConfigError
from server.store_health import StoreHealth
from store import FeedbackStore, Record, new_record_id, open_store

log = logging.getLogger("dlrl.server")
MODES = ("none", "sample", "all")
_TRANSIENT = ("disk_full", "io_error", "unavailable", "locked")  # retried; any other cause drops the batch


class Recorder:
    def __init__(self, store: FeedbackStore, *, mode: str = "none", fraction: float = 0.1, server: str = "",
                 metrics: Any = None, max_pending: int = 10_000, wait_s: float = 5.0, max_batch: int = 256,
                 error_log_s: float = 30.0, seed: int | None = None):
        if mode not in MODES:
            raise ValueError(f"server.record: must be one of {MODES}, got {mode!r}")
        self.store, self.mode, self.fraction, self.server = store, mode, float(fraction), server
        self.metrics, self.max_pending, self.wait_s, self.max_batch = metrics, int(max_pending), wait_s, max_batch
        self.health = StoreHealth(metrics, log_every_s=error_log_s)
        self._rng = random.Random(seed)
        self._cv = threading.Condition()
        self._queue: deque[tuple[list[Record], Future]] = deque()
        self._num_queued = 0          # records queued or being written
        self._closing = False
        self._store_down = False      # the last write failed for a transient cause (retrying)
        self._close_deadline = float("inf")
        if metrics is not None:
            metrics.register_record_queue(lambda: self._num_queued)
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
        except Exception as e:  # sqlite3.Error, OSError, psycopg errors (database down), ImportError
            raise ConfigError(f"server.store: cannot open the feedback store {_redact(config.store)!r}: "
                              f"{type(e).__name__}: {e}") from None
        server = f"http://{config.host}:{config.port}"
        log.info("feedback store %s (record=%s%s)", _redact(config.store), config.record,
                 f", fraction {config.record_fraction}" if config.record == "sample" else "")
        return cls(store, mode=config.record, fraction=config.record_fraction, server=server, metrics=metrics,
                   max_pending=config.record_max_pending, wait_s=config.record_wait_s,
                   error_log_s=config.store_error_log_s)

    # -------------------------------------------------------------- request side (event loop)
    def is_chosen(self) -> bool:
        if self.mode == "all":
            return True
        return self.mode == "sample" and self._rng.random() < self.fraction

    async def record(self, items: list[tuple[Any, str | None]]) -> list[str | None]:
        """Record the chosen finished samples of one request; their ids once committed (else None)."""
        ids: list[str | None] = [None] * len(items)
        chosen: list[tuple[int, Record]] = []
        for i, (seq, prompt) in enumerate(items):
            if seq.finish_reason == "abort" or not self.is_chosen():
                continue
            try:
                chosen.append((i, self._to_record(seq, prompt)))
            except Exception as e:  # a record that cannot be built must not fail the request
                log.error("cannot record a sample: %s: %s", type(e).__name__, e)
                self._dropped("error", 1)
        if not chosen:
            return ids
        fut = self._enqueue([rec for _, rec in chosen])
        if fut is None:
            return ids
        if self._store_down:  # do not hold requests on a failing store: written when it returns
            self._withheld("store_failing", len(chosen))
            return ids
        try:
            written = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.wait_s)
        except asyncio.TimeoutError:
            written = None
        if not written:
            self._withheld("store_failing" if written is False else "timeout", len(chosen))
            return ids
        for i, rec in chosen:
            ids[i] = rec.id
        return ids

    def _to_record(self, seq: Any, prompt: str | None) -> Record:
        trace = {**seq.trace.model_dump(), "finish_reason": seq.finish_reason}
        return Record(id=new_record_id(), created=time.time(), server=self.server, version=int(seq.trace.version),
                      prompt=prompt, prompt_ids=list(seq.prompt_ids), completion_ids=list(seq.completion_ids),
                      text=seq.text, finish_reason=seq.finish_reason, trace=trace,
                      sampling=dataclasses.asdict(seq.params))

    def _enqueue(self, records: list[Record]) -> Future | None:
        with self._cv:
            if self._closing or self._num_queued + len(records) > self.max_pending:
                full = not self._closing
            else:
                fut: Future = Future()
                self._queue.append((records, fut))
                self._num_queued += len(records)
                self._cv.notify()
                return fut
        self._dropped("queue_full" if full else "shutdown", len(records))
        if full:
            self.health.failed("record", OverflowError(f"recording queue full ({self.max_pending} records "
                                                       "waiting: the store cannot keep up)"), "queue_full")
        return None

    def _dropped(self, reason: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.records_dropped.labels(reason=reason).inc(n)

    def _withheld(self, reason: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.record_ids_withheld.labels(reason=reason).inc(n)

    # -------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        batch: list[tuple[list[Record], Future]] = []
        backoff = 0.05
        while True:
            with self._cv:
                while not self._queue and not batch and not self._closing:
                    self._cv.wait()
                while self._queue and sum(len(r) for r, _ in batch) < self.max_batch:
                    batch.append(self._queue.popleft())
                if not batch:
                    return  # closing, nothing left
            if self._write(batch):
                batch, backoff = [], 0.05
            elif time.monotonic() > self._close_deadline:
                n = sum(len(r) for r, _ in batch) + sum(len(r) for r, _ in self._queue)
                log.error("feedback store: %d queued records not written at shutdown", n)
                self._dropped("shutdown", n)
                return
            else:
                with self._cv:
                    self._cv.wait(timeout=backoff)
                backoff = min(2.0, backoff * 2)

    def _write(self, batch: list[tuple[list[Record], Future]]) -> bool:
        """Write a batch in one transaction: True when done with it (written, or dropped for a
        non-transient cause), False to retry it later (its requests are answered without ids)."""
        records = [rec for recs, _ in batch for rec in recs]
        t0 = time.perf_counter()
        try:
            self.store.add_records(records)
        except Exception as e:
            cause = self.health.failed("record", e)
            _resolve(batch, False)
            if cause in _TRANSIENT:
                self._store_down = True
                return False
            self._dropped("error", len(records))
            self._done(len(records))
            return True
        self._store_down = False
        self.health.ok()
        if self.metrics is not None:
            self.metrics.records.inc(len(records))
            self.metrics.record_write_seconds.observe(time.perf_counter() - t0)
        self._done(len(records))
        _resolve(batch, True)
        return True

    def _done(self, n: int) -> None:
        with self._cv:
            self._num_queued -= n
            self._cv.notify_all()

    # -------------------------------------------------------------- feedback (worker thread)
    def add_feedback(self, record_id: str, reward: float, label: str | None = None) -> bool:
        """store.add_feedback (KeyError, FeedbackConflict as the store raises them); a failure
        of the store itself is counted and logged by cause, then raised."""
        try:
            is_new = self.store.add_feedback(record_id, reward, label)
        except (KeyError, ValueError):
            self.health.ok()
            raise
        except Exception as e:
            self.health.failed("feedback", e)
            raise
        self.health.ok()
        return is_new

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued record is written (tests, shutdown)."""
        with self._cv:
            self._cv.wait_for(lambda: self._num_queued == 0, timeout=timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking records, write what is queued (up to `timeout` s), close the store."""
        with self._cv:
            self._closing = True
            self._close_deadline = time.monotonic() + timeout
            self._cv.notify_all()
        self._writer.join(timeout=timeout + 5)
        self.store.close()


def _resolve(batch: list[tuple[list[Record], Future]], ok: bool) -> None:
    for _, fut in batch:
        try:
            if not fut.done():
                fut.set_result(ok)
        except InvalidStateError:  # resolved by an earlier try, or cancelled
            pass


def _redact(url: str) -> str:
    """A store location for logs: a database URL without its password."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}" if ":" in creds else url


async def record_ids(state: Any, seqs: list[Any], prompts: list[Any] | None = None, n: int = 1) -> list[str | None]:
    """The record_id of each finished sequence of a request (prompt-major, n per prompt; all
    None when the server records nothing). Text prompts are stored; token-id prompts as None."""
    recorder = getattr(state, "recorder", None)
    if recorder is None or recorder.mode == "none":
        return [None] * len(seqs)
    items = [(seq, p if isinstance(p := (prompts[i // n] if prompts else None), str) else None)
             for i, seq in enumerate(seqs)]
    return await recorder.record(items)


async def record_one(state: Any, seq: Any, prompt: Any = None) -> str | None:
    return (await record_ids(state, [seq], [prompt]))[0]
