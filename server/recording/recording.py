"""Recording served samples into the feedback store: written before the id is handed out.

    store = open_feedback_store(config)                        # server.api.app does it; None = no store
    recorder = Recorder.from_config(config, engine, store, metrics)   # None without a store
    ids = await recorder.record([(seq, prompt), ...])          # record_id per sample, or None
    recorder.add_feedback(record_id, 1.0, "accept")            # in a worker thread (routes_feedback)

`server.record` says which samples are recorded: `none`, `sample` (each finished sample
with probability `server.record_fraction`) or `all`. Aborted and failed samples are never
recorded (a sample that finished before the rest of its request was aborted or failed may be
written; its id is never handed out).

An id returned to a client is always valid. `expect()` chooses a request's samples before it
runs (server/api/generation.py); each chosen sample is handed to the writer the moment the engine
core's message says it finished, before its request hears of it (`CoreClient.add_finish_listener`,
server.core.client), through a bounded queue
(`server.record_max_pending` records) to one writer thread, which builds the records and
writes whatever is queued in ONE transaction (batched across the requests that finished in
the same step, off the event loop) and wakes the waiting requests with one
`call_soon_threadsafe` per batch. The commit thus runs while the finished request is still on
its way back through a busy event loop: `record()` awaits what is left of it, at most
`server.record_wait_s`, and only then answers with the ids. (Waiting for the commit after the
request came back kept its client away from the engine for a commit's time: smaller batches,
more forwards per request, a throughput cost on a busy server.)
What is not written by then is answered with `record_id: null` (counted in
`dlrl_record_ids_withheld_total{reason}`) and still written when it can be. While the store
is failing (full disk, database down) requests do not wait at all: records stay queued and
are retried with backoff until the store returns; when the queue is full the newest are
dropped (`dlrl_records_dropped_total{reason="queue_full"}`), a record the store cannot hold
(a NUL in PostgreSQL text: `reason="refused"`, alone: the rest of its batch is written) or
that fails for another reason is dropped too (`reason="error"`), and failures are logged by
cause (server/recording/store_health.py). Recording never fails a request.

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

from dllm.trace import FinishReason
from dlrl_config import ConfigError
from server.engine.sequence import ServerSequence as Sequence
from server.recording.store_health import StoreHealth
from store import FeedbackStore, Record, error_cause, new_record_id, open_store

if TYPE_CHECKING:
    from dllm.sampling import SamplingParams
    from server.config import ServerConfig
    from server.core.client import CoreClient
    from server.metrics import ServerMetrics

log = logging.getLogger("dlrl.server")
MODES = ("none", "sample", "all")
_TRANSIENT = ("disk_full", "io_error", "unavailable", "locked")  # retried; any other cause drops the batch


def open_feedback_store(config: ServerConfig) -> FeedbackStore | None:
    """The app's feedback store (`server.store`): None when neither recording nor feedback needs one;
    ConfigError naming server.store when it cannot be opened."""
    if config.record == "none" and not config.resolved_feedback_token():
        return None
    try:
        store = open_store(config.store, max_records=config.store_max_records, max_age_s=config.store_max_age_s)
    except Exception as e:  # sqlite3.Error, OSError, psycopg errors (database down), ImportError
        raise ConfigError(f"server.store: cannot open the feedback store {_redact(config.store)!r}: "
                          f"{type(e).__name__}: {e}") from None
    log.info("feedback store %s (record=%s%s)", _redact(config.store), config.record,
             f", fraction {config.record_fraction}" if config.record == "sample" else "")
    return store


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
        self._queue: deque[_Sample] = deque()
        self._num_queued = 0          # records queued or being written
        self._closing = False
        self._store_down = False      # the last write failed for a transient cause (retrying)
        self._close_deadline = float("inf")
        if metrics is not None:
            metrics.register_record_queue(lambda: self._num_queued)
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="dlrl-recorder")
        self._writer.start()

    @classmethod
    def from_config(cls, config: ServerConfig, engine: CoreClient, store: FeedbackStore | None,
                    metrics: ServerMetrics | None = None) -> Recorder | None:
        """The app's recorder of `store` (open_feedback_store's; None: no recorder)."""
        if store is None:
            return None
        server = f"http://{config.host}:{config.port}"
        recorder = cls(store, mode=config.record, fraction=config.record_fraction, server=server, metrics=metrics,
                       max_pending=config.record_max_pending, wait_s=config.record_wait_s,
                       error_log_s=config.store_error_log_s)
        if recorder.mode != "none":  # a feedback-only store records nothing
            engine.add_finish_listener(recorder._finished)
        return recorder

    # -------------------------------------------------------------- request side (event loop)
    def is_chosen(self) -> bool:
        if self.mode == "all":
            return True
        return self.mode == "sample" and self._rng.random() < self.fraction

    def expect(self, seqs: list[Sequence], prompts: abc.Sequence[object] | None = None, n: int = 1) -> None:
        """Choose, before a request runs, which of its samples are recorded (prompt-major, n per
        prompt; text prompts are stored, token-id prompts as None). The engine client then hands each
        chosen sample to the writer the moment it finishes (`_finished`), so its commit runs while
        the request is still on its way back through the event loop, and `record()` only waits for
        what is left."""
        if self.mode == "none":
            return
        for i, seq in enumerate(seqs):
            self._choose(seq, _prompt_of(prompts, i, n))

    def _choose(self, seq: Sequence, prompt: str | None) -> _Sample | None:
        """Decide once whether `seq` is recorded; the decision (its _Sample, or None) stays on it."""
        sample = _Sample(seq, prompt) if self.is_chosen() else None
        seq.recording = sample if sample is not None else _NOT_CHOSEN
        return sample

    async def record(self, items: list[tuple[Sequence, str | None]]) -> list[str | None]:
        """The record ids of a request's finished samples, once committed (else None): those chosen
        by `expect()`, or chosen now for sequences that went without it."""
        ids: list[str | None] = [None] * len(items)
        samples: list[tuple[int, _Sample]] = []
        for i, (seq, prompt) in enumerate(items):
            sample = seq.recording
            if sample is None:  # not decided by expect(): decide now
                sample = self._choose(seq, prompt)
            if isinstance(sample, _Sample):
                samples.append((i, sample))
        if not samples:
            return ids
        self._enqueue([s for _, s in samples])  # those the engine has not handed over (no-op for the rest)
        loop = asyncio.get_running_loop()
        waiter = None
        with self._cv:
            left = [s for _, s in samples if s.state == _QUEUED]
            failing = self._store_down or any(s.state == _FAILING for _, s in samples)
            if left and not failing:  # else do not hold requests on a failing store: written when it returns
                waiter = _Waiter(loop, len(left))
                for s in left:
                    s.waiter = waiter
        written = None
        if waiter is not None:
            timer = loop.call_later(self.wait_s, _wake, waiter.future, None)
            try:  # a cancelled request cancels only its waiter: the records are still written
                written = await waiter.future
            finally:
                timer.cancel()
        num_withheld = 0
        for i, sample in samples:
            if sample.state == _WRITTEN:
                ids[i] = sample.id
            else:
                num_withheld += sample.state in (_QUEUED, _FAILING)
        if num_withheld:
            self._withheld("timeout" if waiter is not None and written is None else "store_failing", num_withheld)
        return ids

    def _finished(self, seqs: list[Sequence]) -> None:
        """(the API loop, as the core says they ended) Hand the chosen samples that finished to the writer."""
        samples = [s for seq in seqs if isinstance(s := seq.recording, _Sample)]
        if samples:
            self._enqueue(samples)

    def _enqueue(self, samples: list[_Sample]) -> None:
        """Queue the finished samples not queued yet (aborted and failed ones are never recorded); when
        the queue cannot take them all, none of them (counted, logged)."""
        with self._cv:
            new = [s for s in samples if s.state == _CHOSEN and s.seq is not None
                   and s.seq.finish_reason not in (None, FinishReason.ABORT, FinishReason.ERROR)]
            if not new:
                return
            if not self._closing and self._num_queued + len(new) <= self.max_pending:
                now = time.time()
                for s in new:
                    s.state, s.created = _QUEUED, now
                self._queue.extend(new)
                self._num_queued += len(new)
                self._cv.notify()
                return
            full = not self._closing
            for s in new:
                s.state = _DROPPED
        self._dropped("queue_full" if full else "shutdown", len(new))
        if full:
            self.health.failed("record", OverflowError(f"recording queue full ({self.max_pending} records "
                                                       "waiting: the store cannot keep up)"), "queue_full")

    def _build(self, sample: _Sample) -> Record | None:
        """The Record of a sample (writer thread); one that cannot be built is dropped, counted."""
        seq = sample.seq
        try:
            if seq is None or seq.finish_reason is None:
                raise ValueError("only a finished sequence is recorded")
            return Record(
                id=sample.id, created=sample.created, server=self.server, version=int(seq.trace.version),
                prompt=sample.prompt, prompt_ids=list(seq.prompt_ids), completion_ids=list(seq.completion_ids),
                text=seq.text, finish_reason=seq.finish_reason, sampling=_params(seq.params),
                trace=seq.trace.published(seq.finish_reason).model_dump())
        except Exception as e:  # a record that cannot be built must not fail the request
            log.error("cannot record a sample: %s: %s", type(e).__name__, e)
            self._dropped("error", 1)
            return None

    def _dropped(self, reason: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.records_dropped.labels(reason=reason).inc(n)

    def _withheld(self, reason: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.record_ids_withheld.labels(reason=reason).inc(n)

    # -------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        batch: list[_Sample] = []
        backoff = 0.05
        while True:
            with self._cv:
                while not self._queue and not batch and not self._closing:
                    self._cv.wait()
                while self._queue and len(batch) < self.max_batch:
                    batch.append(self._queue.popleft())
                if not batch:
                    return  # closing, nothing left
            unbuildable = []
            for s in batch:  # built here, off the event loop and outside the lock (a retried one already is)
                if s.record is None:
                    s.record = self._build(s)
                    s.seq = None  # the record holds what is kept: no sequence <-> sample cycle left for the GC
                    if s.record is None:
                        unbuildable.append(s)
            if unbuildable:
                self._settle(unbuildable, _DROPPED)
                batch = [s for s in batch if s.record is not None]
            if not batch or self._write(batch):
                batch, backoff = [], 0.05
            elif time.monotonic() > self._close_deadline:
                n = len(batch) + len(self._queue)
                log.error("feedback store: %d queued records not written at shutdown", n)
                self._dropped("shutdown", n)
                return
            else:  # the full backoff: new requests' notify() must not turn it into a retry per request
                with self._cv:
                    self._cv.wait_for(lambda: self._closing, timeout=backoff)
                backoff = min(2.0, backoff * 2)

    def _write(self, batch: list[_Sample]) -> bool:
        """Write a batch in one statement: True when done with it (written, or dropped for a
        non-transient cause), False to retry what is left of it later (`batch` keeps only those;
        their requests are answered without ids). A batch the store refuses for what a record holds
        (cause `refused`: a NUL, which PostgreSQL text cannot hold and a prompt can carry) is
        written again one record at a time, so such a record costs only its own request its id,
        never the other requests' that finished in the same step."""
        error = self._commit(batch)
        if error is None:
            return True
        cause = error_cause(error)
        if cause in _TRANSIENT:
            return self._failing(batch, error, cause)
        if cause != "refused" or len(batch) == 1:  # the store fails (another cause), or one refused record
            self._drop(batch, error, cause)
            return True
        for k, s in enumerate(list(batch)):
            error = self._commit([s])
            if error is None:
                continue
            cause = error_cause(error)
            if cause in _TRANSIENT:  # an outage began: retry what is not settled yet
                del batch[:k]
                return self._failing(batch, error, cause)
            self._drop([s], error, cause)
        return True

    def _failing(self, batch: list[_Sample], error: Exception, cause: str) -> bool:
        """The store is down (a transient cause): keep the batch for a retry; its requests answer now."""
        self.health.failed("record", error, cause)
        self._store_down = True
        self._settle(batch, _FAILING)
        return False

    def _drop(self, samples: list[_Sample], error: Exception, cause: str) -> None:
        """Drop samples for good: refused ones (what they hold) without marking the store down."""
        if cause == "refused":
            self.health.refused("record", error, len(samples))
        else:
            self.health.failed("record", error, cause)
        self._dropped("refused" if cause == "refused" else "error", len(samples))
        self._settle(samples, _DROPPED)

    def _commit(self, batch: list[_Sample]) -> Exception | None:
        """Add the batch's records to the store: None once written (settled), else the error."""
        records = [s.record for s in batch if s.record is not None]
        t0 = time.perf_counter()
        try:
            self.store.add_records(records)
        except Exception as e:
            return e
        self._store_down = False
        self.health.ok()
        if self.metrics is not None:
            self.metrics.records.inc(len(records))
            self.metrics.record_write_seconds.observe(time.perf_counter() - t0)
        self._settle(batch, _WRITTEN)
        return None

    def _settle(self, samples: list[_Sample], state: int) -> None:
        """Move samples to `state` and wake the requests that can answer now: a request once all its
        samples are written, at once when one is dropped or the store fails; one call_soon_threadsafe
        per event loop (a single wake-up of a busy loop for the whole batch, not one per request)."""
        wake: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, bool]]] = {}
        with self._cv:
            for s in samples:
                s.state, w = state, s.waiter
                if state != _FAILING:
                    s.record = None  # written or dropped: only the state is read from now on
                if w is not None and w.left > 0:
                    w.left = w.left - 1 if state == _WRITTEN else 0
                    if not w.left:
                        wake.setdefault(w.loop, []).append((w.future, state == _WRITTEN))
            if state != _FAILING:  # written or dropped: done with them
                self._num_queued -= len(samples)
                self._cv.notify_all()
        for loop, futures in wake.items():
            try:
                loop.call_soon_threadsafe(_wake_all, futures)
            except RuntimeError:  # the loop is closed (shutdown): nobody waits
                pass

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


_CHOSEN, _QUEUED, _FAILING, _WRITTEN, _DROPPED = range(5)  # a sample's way to the store
_NOT_CHOSEN = object()  # ServerSequence.recording of a sequence decided not to be recorded (None: undecided)


class _Sample:
    """One chosen sample on its way to the store: `state` moves (under the recorder's lock) from
    _CHOSEN to _QUEUED once it finished, then to _WRITTEN or _DROPPED (_FAILING while the store
    fails and it waits for a retry); `waiter` is the request waiting for it, if any."""
    __slots__ = ("seq", "prompt", "id", "created", "state", "waiter", "record")

    def __init__(self, seq: Sequence, prompt: str | None):
        self.seq: Sequence | None = seq
        self.prompt, self.id = prompt, new_record_id()
        self.created = 0.0
        self.state = _CHOSEN
        self.waiter: _Waiter | None = None
        self.record: Record | None = None


class _Waiter:
    """A request waiting for `left` samples: `future` (of `loop`) gets True once all are written,
    False as soon as one fails or is dropped, None at the request's timeout."""
    __slots__ = ("loop", "future", "left")

    def __init__(self, loop: asyncio.AbstractEventLoop, left: int):
        self.loop, self.future, self.left = loop, loop.create_future(), left


_FIELDS: dict[type, tuple[str, ...]] = {}  # a dataclass's field names, by type


def _params(params: SamplingParams) -> dict[str, object]:
    """dataclasses.asdict of SamplingParams (flat: lists copied), without its generic recursion."""
    names = _FIELDS.get(type(params)) or _FIELDS.setdefault(type(params), tuple(f.name for f in dataclasses.fields(params)))
    return {k: list(v) if isinstance(v := getattr(params, k), list) else v for k in names}


def _prompt_of(prompts: abc.Sequence[object] | None, i: int, n: int) -> str | None:
    """The stored prompt of sample i (prompt-major, n per prompt): its text, None for token ids."""
    p = prompts[i // n] if prompts else None
    return p if isinstance(p, str) else None


def _wake(waiter: asyncio.Future, ok: bool | None) -> None:
    if not waiter.done():
        waiter.set_result(ok)


def _wake_all(futures: list[tuple[asyncio.Future, bool]]) -> None:
    for future, ok in futures:
        _wake(future, ok)


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
    return await recorder.record([(seq, _prompt_of(prompts, i, n)) for i, seq in enumerate(seqs)])


async def record_one(recorder: Recorder | None, seq: Sequence, prompt: object = None) -> str | None:
    return (await record_ids(recorder, [seq], [prompt]))[0]
