"""Recording served samples into the feedback store: written before the id is handed out.

    recorder = Recorder.from_config(config, engine, metrics)   # server.app does it; None = no store
    ids = await recorder.record([(seq, prompt), ...])          # record_id per sample, or None
    recorder.add_feedback(record_id, 1.0, "accept")            # in a worker thread (routes_feedback)

`server.record` says which samples are recorded: `none`, `sample` (each finished sample
with probability `server.record_fraction`) or `all`. Aborted samples are never recorded.

An id returned to a client is always valid. A request's chosen samples go through a bounded
queue (`server.record_max_pending` records) to one writer thread, which builds their records
and writes whatever is queued in ONE transaction (batched across concurrent requests, off the
event loop) and wakes each waiting request with one `call_soon_threadsafe` (a single hop back
onto a busy event loop, not a chain of wrapped futures); the request awaits that commit, at
most `server.record_wait_s`, and only then answers with the ids.
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
from collections import abc, deque
from typing import TYPE_CHECKING

from dllm.sequence import Sequence
from dllm.trace import FinishReason
from dlrl_config import ConfigError
from server.store_health import StoreHealth
from store import FeedbackStore, Record, new_record_id, open_store

if TYPE_CHECKING:
    from server.config import ServerConfig
    from server.engine import Engine
    from server.metrics import ServerMetrics

log = logging.getLogger("dlrl.server")
MODES = ("none", "sample", "all")
_TRANSIENT = ("disk_full", "io_error", "unavailable", "locked")  # retried; any other cause drops the batch


class Recorder:
    def __init__(self, store: FeedbackStore, *, mode: str = "none", fraction: float = 0.1, server: str = "",
                 metrics: ServerMetrics | None = None, max_pending: int = 10_000, wait_s: float = 5.0, max_batch: int = 256,
                 error_log_s: float = 30.0, seed: int | None = None):
        if mode not in MODES:
            raise ValueError(f"server.record: must be one of {MODES}, got {mode!r}")
        self.store, self.mode, self.fraction, self.server = store, mode, float(fraction), server
        self.metrics, self.max_pending, self.wait_s, self.max_batch = metrics, int(max_pending), wait_s, max_batch
        self.health = StoreHealth(metrics, log_every_s=error_log_s)
        self._rng = random.Random(seed)
        self._cv = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._num_queued = 0          # records queued or being written
        self._closing = False
        self._store_down = False      # the last write failed for a transient cause (retrying)
        self._close_deadline = float("inf")
        if metrics is not None:
            metrics.register_record_queue(lambda: self._num_queued)
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="dlrl-recorder")
        self._writer.start()

    @classmethod
    def from_config(cls, config: ServerConfig, engine: Engine, metrics: ServerMetrics | None = None) -> Recorder | None:
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

    async def record(self, items: list[tuple[Sequence, str | None]]) -> list[str | None]:
        """Record the chosen finished samples of one request; their ids once committed (else None)."""
        ids: list[str | None] = [None] * len(items)
        chosen = [(i, seq, prompt, new_record_id()) for i, (seq, prompt) in enumerate(items)
                  if seq.finish_reason != FinishReason.ABORT and self.is_chosen()]
        if not chosen:
            return ids
        # the writer thread builds the records (off the event loop) and answers through the
        # waiter with one call_soon_threadsafe: a single hop back onto a busy loop
        loop = asyncio.get_running_loop()
        pending = _Pending(chosen, time.time(), loop, loop.create_future())
        if not self._enqueue(pending):
            return ids
        if self._store_down:  # do not hold requests on a failing store: written when it returns
            self._withheld("store_failing", len(chosen))
            return ids
        timer = loop.call_later(self.wait_s, _wake, pending.waiter, None)
        try:  # a cancelled request cancels only its waiter: the records are still written
            written = await pending.waiter
        finally:
            timer.cancel()
        if not written:
            self._withheld("store_failing" if written is False else "timeout", len(chosen))
            return ids
        committed = {rec.id for rec in pending.records}  # without those that could not be built
        for i, *_, rid in chosen:
            ids[i] = rid if rid in committed else None
        return ids

    def _build(self, pending: _Pending) -> list[Record]:
        """The Records of a request (writer thread); one that cannot be built is dropped, counted."""
        out = []
        for _, seq, prompt, rid in pending.items:
            try:
                if seq.finish_reason is None:
                    raise ValueError("only a finished sequence is recorded")
                out.append(Record(
                    id=rid, created=pending.created, server=self.server, version=int(seq.trace.version), prompt=prompt,
                    prompt_ids=list(seq.prompt_ids), completion_ids=list(seq.completion_ids), text=seq.text,
                    finish_reason=seq.finish_reason, sampling=dataclasses.asdict(seq.params),
                    trace={**seq.trace.model_dump(), "finish_reason": seq.finish_reason}))
            except Exception as e:  # a record that cannot be built must not fail the request
                log.error("cannot record a sample: %s: %s", type(e).__name__, e)
                self._dropped("error", 1)
        return out

    def _enqueue(self, pending: _Pending) -> bool:
        n = len(pending.items)
        with self._cv:
            if self._closing or self._num_queued + n > self.max_pending:
                full = not self._closing
            else:
                self._queue.append(pending)
                self._num_queued += n
                self._cv.notify()
                return True
        self._dropped("queue_full" if full else "shutdown", n)
        if full:
            self.health.failed("record", OverflowError(f"recording queue full ({self.max_pending} records "
                                                       "waiting: the store cannot keep up)"), "queue_full")
        return False

    def _dropped(self, reason: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.records_dropped.labels(reason=reason).inc(n)

    def _withheld(self, reason: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.record_ids_withheld.labels(reason=reason).inc(n)

    # -------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        batch: list[_Pending] = []
        backoff = 0.05
        while True:
            with self._cv:
                while not self._queue and not batch and not self._closing:
                    self._cv.wait()
                taken, n = [], sum(len(p.records) for p in batch)
                while self._queue and n < self.max_batch:
                    taken.append(self._queue.popleft())
                    n += len(taken[-1].items)
                if not batch and not taken:
                    return  # closing, nothing left
            for pending in taken:  # built here, off the event loop and outside the lock
                built = self._build(pending)
                self._done(len(pending.items) - len(built))  # the ones that could not be built
                pending.items, pending.records = [], built
                batch.append(pending)
            if self._write(batch):
                batch, backoff = [], 0.05
            elif time.monotonic() > self._close_deadline:
                n = sum(len(p.records) for p in batch) + sum(len(p.items) for p in self._queue)
                log.error("feedback store: %d queued records not written at shutdown", n)
                self._dropped("shutdown", n)
                return
            else:  # the full backoff: new requests' notify() must not turn it into a retry per request
                with self._cv:
                    self._cv.wait_for(lambda: self._closing, timeout=backoff)
                backoff = min(2.0, backoff * 2)

    def _write(self, batch: list[_Pending]) -> bool:
        """Write a batch in one transaction: True when done with it (written, or dropped for a
        non-transient cause), False to retry it later (its requests are answered without ids)."""
        records = [rec for p in batch for rec in p.records]
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
        if not n:
            return
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


class _Pending:
    """One request's chosen samples on their way to the store: (index, seq, prompt, id) until
    the writer builds their Records; `waiter` (a future of `loop`) gets True once committed,
    False while the store fails."""
    __slots__ = ("items", "created", "loop", "waiter", "records")

    def __init__(self, items: list, created: float, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future):
        self.items, self.created, self.loop, self.waiter = items, created, loop, waiter
        self.records: list[Record] = []


def _wake(waiter: asyncio.Future, ok: bool | None) -> None:
    if not waiter.done():
        waiter.set_result(ok)


def _resolve(batch: list[_Pending], ok: bool) -> None:
    for p in batch:
        if p.waiter.done():  # answered by an earlier try, or timed out: no wake-up needed
            continue
        try:
            p.loop.call_soon_threadsafe(_wake, p.waiter, ok)
        except RuntimeError:  # the loop is closed (shutdown): nobody waits
            pass


def _redact(url: str) -> str:
    """A store location for logs: a database URL without its password."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}" if ":" in creds else url


async def record_ids(recorder: Recorder | None, seqs: list[Sequence], prompts: abc.Sequence[object] | None = None,
                     n: int = 1) -> list[str | None]:
    """The record_id of each finished sequence of a request (prompt-major, n per prompt; all
    None when the server records nothing: `recorder` is the app's, `ServerState.recorder`).
    Text prompts are stored; token-id prompts as None."""
    if recorder is None or recorder.mode == "none":
        return [None] * len(seqs)
    items = [(seq, p if isinstance(p := (prompts[i // n] if prompts else None), str) else None)
             for i, seq in enumerate(seqs)]
    return await recorder.record(items)


async def record_one(recorder: Recorder | None, seq: Sequence, prompt: object = None) -> str | None:
    return (await record_ids(recorder, [seq], [prompt]))[0]
