"""Engine: continuous batching of block-diffusion decoding in one background thread.

    engine = Engine(NativeBackend(model, tokenizer, max_batch=16), max_queue=256)
    engine.start()
    seqs = engine.make_sequences([[5, 6, 7]], SamplingParams(max_tokens=32), n=4)
    req = engine.submit(seqs)              # from an asyncio handler; QueueFull -> 429
    await engine.wait(req)                 # -> the finished Sequences (completion, text, trace)
    await engine.apply_update(7, copy)     # weight update window: pause -> copy -> version 7 -> resume

Each engine step reads schedule -> run -> post-process (`Engine._iterate`), three layers down to the
model (Engine -> Runner -> the model's step):

    batch = scheduler.schedule(...)        # abort expired, release aborted, admit what fits the KV budget
    backend.release(batch.left)            # the one place the runner hears which sequences left
    out = backend.run(batch)               # the runner (server/engine/backends/base.py): ONE batched forward
    ended = scheduler.postprocess(batch, out, now)   # stop ids / strings, max_tokens, finish reason, pages back
    deliver: top logprobs, finish listeners, request events, stream updates

so concurrent requests share every forward, whatever each sequence's prompt, position, block,
strategy or sampling params. The scheduler owns every sequence (server/engine/sequence.py: status,
timings, deadline) and, through its block manager (dllm.block_manager), every slot and KV page:
the runner only runs. A sequence the runner failed alone
(`seq.error`, e.g. non-finite probabilities) fails only its own request (`RequestFailed`: the
server answers a 500 with its message); the others go on.

`pause()` stops admission and waits until no sequence runs and no forward is in flight
(with `abort_inflight=True` it aborts the running ones first); while paused and drained
nothing touches `engine.model`, so the weight-sync receiver can copy weights into it.
Every sequence is stamped with `version` when admitted (Scheduler.schedule); pausing drains before an update,
so a sequence never mixes versions. The engine is in one `EngineState` (running, paused,
stopped); a forward only runs over the scheduler's running sequences, which the engine
thread drops only once it is over, so "drained" is: nothing running or releasing. A
pause() waits on a future that the engine thread resolves when it drains (no polling).
Events of a request are (`EngineEvent`, sequence index, payload).
The engine owns the served version: only `apply_update` (pause -> copy in a worker
thread -> set version -> resume) changes it, for a weight update and a rollback alike
(server.weights.weight_updates).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

from dllm.postprocess import StepOutput
from dllm.sampling_params import SamplingParams
from dllm.trace import FinishReason
from server.engine.backends.base import Runner, RunnerInfo
from server.engine.readout import EngineReadout, EngineState
from server.engine.scheduler import QueueFull, Request, ScheduledBatch, Scheduler
from server.engine.sequence import ServerSequence, samples

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase  # no types to mypy: it does not follow transformers

log = logging.getLogger("dlrl.server")
T = TypeVar("T")
__all__ = ["Engine", "EngineEvent", "EngineState", "EngineStopped", "QueueFull", "Request", "RequestExpired", "RequestFailed",
           "StepStats", "request_events", "wait_request"]


class EngineEvent(StrEnum):
    UPDATE = "update"    # streams only: payload (completion ids, text) after a block committed
    DONE = "done"        # payload None: read the Sequence
    ERROR = "error"      # payload: the message


EventPayload = tuple[list[int], str] | str | None  # UPDATE: (completion ids, text); DONE: None; ERROR: message
EngineEventTuple = tuple[EngineEvent, int, EventPayload]  # (kind, sequence index, payload)


class EngineStopped(RuntimeError):
    """The engine is shut down (or its thread died); no new requests."""


class RequestFailed(RuntimeError):
    """A sequence of the request failed in the engine; the message says why (the server answers 500)."""


class RequestExpired(RequestFailed):
    """The request ran past its deadline and was aborted; `deadline_status` is the status its deadline was
    set with (`Sequence.deadline_status`, by server.api.generation: 408 its own timeout, 503 the server's limit)."""

    def __init__(self, message: str, deadline_status: int):
        super().__init__(message)
        self.deadline_status = deadline_status


class EventSource(Protocol):
    """A submitted request as its handler reads it: the Engine's Request, the API process's RemoteRequest."""

    @property
    def seqs(self) -> list[ServerSequence]: ...
    @property
    def events(self) -> asyncio.Queue[EngineEventTuple]: ...
    @property
    def expired(self) -> str: ...


async def request_events(req: EventSource) -> AsyncIterator[EngineEventTuple]:
    """Yield (kind, seq index, payload) events until every sequence is done or failed.

    kinds (EngineEvent): UPDATE (streams only; payload = (completion ids, text) after a block
    committed), DONE (payload None; read the Sequence), ERROR (payload = message).
    """
    num_left = len(req.seqs)
    while num_left:
        event = await req.events.get()
        num_left -= event[0] != EngineEvent.UPDATE
        yield event


async def wait_request(req: EventSource, expired: Callable[[], RequestFailed]) -> list[ServerSequence]:
    """Wait for every sequence of `req`; returns them in request order. A failed sequence raises: `expired()`
    when the request was aborted at its deadline (`req.expired`), else RequestFailed naming the sample."""
    async for kind, index, payload in request_events(req):
        if kind == EngineEvent.ERROR and req.expired:
            raise expired()
        if kind == EngineEvent.ERROR:
            raise RequestFailed(f"sample {index}: {payload}" if len(req.seqs) > 1 else payload)
    return req.seqs


@dataclass
class StepStats:
    batch_size: int      # sequences in the forward
    num_tokens: int      # tokens committed by it
    seconds: float       # wall time of admission prefill + forward
    num_admitted: int
    num_waiting: int
    seqs: tuple[ServerSequence, ...] = ()      # the batch (after the forward), for per-sequence latency metrics
    admitted: tuple[ServerSequence, ...] = ()  # sequences admitted into this forward
    num_cache_refused: int = 0    # waiting sequences a free slot could take but the KV-cache pages could not


class Engine(EngineReadout):
    backend: Runner

    def __init__(self, backend: Runner, *, max_queue: int = 256, max_queue_tokens: int | None = None,
                 model_name: str = "dlrl"):
        """`max_queue_tokens` (server.max_queue_tokens): prompt + max_tokens of the waiting sequences at most;
        0: 4x the tokens the KV cache holds; None: no bound (an engine no server serves)."""
        self.backend, self.model_name = backend, model_name  # the model runner
        self._version = 0  # the served weight version: written only by apply_update
        kv = backend.kv_budget
        if max_queue_tokens == 0:
            max_queue_tokens = 4 * (kv.num_tokens or backend.max_batch * backend.max_len)  # unpaged: slots x length
        self.scheduler = Scheduler(max_queue, max_queue_tokens or 0, kv=kv, post=backend.postprocessor())
        self.max_batch_seen = 0
        self.num_steps = 0
        self.num_aborted = 0
        self._cond = threading.Condition()
        self._state = EngineState.RUNNING
        self._drain_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []  # pause() calls
        self._thread: threading.Thread | None = None
        self._listeners: list[Callable[[StepStats], None]] = []
        self._finish_listeners: list[Callable[[list[ServerSequence]], None]] = []
        self._emitted: dict[int, int] = {}  # seq_id -> completion tokens already streamed
        self._calls: list[_Pending] = []  # call_between_steps not run yet
        self._num_calls_running = 0

    # ------------------------------------------------------------------ properties
    @property
    def model(self) -> torch.nn.Module:
        return self.backend.model

    @property
    def version(self) -> int:
        """The served weight version (read-only: `apply_update` changes it)."""
        return self._version

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.backend.tokenizer

    @property
    def info(self) -> RunnerInfo:
        """What the runner supports (family, cache mode, logprobs, likelihoods, prefix sharing, weights)."""
        return self.backend.info

    # state, is_running, is_paused, num_running, num_waiting, max_model_len: EngineReadout's, from these three
    # and the backend
    def _last_state(self) -> EngineState:
        return self._state

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _counts(self) -> Scheduler:
        return self.scheduler

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    def add_finish_listener(self, fn: Callable[[list[ServerSequence]], None]) -> None:
        """`fn(sequences)` on the engine thread with the sequences that finished in a step, before
        their requests hear of it (server/recording/recording.py starts their commit there); it runs on the
        decode path, so it must be quick, and it must not raise (logged if it does)."""
        self._finish_listeners.append(fn)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dlrl-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._state = EngineState.STOPPED
            self._cond.notify_all()
            self._wake_drained()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            for seq in self.scheduler.take_all():
                self._finish(seq)
            calls, self._calls = self._calls, []
        for call in calls:  # call_between_steps never run
            call.settle(None, EngineStopped("engine is not running"))
        self.backend.close()

    # ------------------------------------------------------------------ requests
    def make_sequences(self, prompts_ids: list[list[int]], params: SamplingParams, n: int = 1) -> list[ServerSequence]:
        """Validated Sequences, prompt-major; sample i of each prompt uses seed + i (when seeded)."""
        return [self.backend.new_sequence(ids, p) for ids, p in samples(prompts_ids, params, n)]

    def submit(self, seqs: list[ServerSequence], stream: bool = False, num_top_logprobs: int = 0,
               sink: Callable[[Request, EngineEventTuple], None] | None = None) -> Request:
        """Queue the sequences of one request (call from the event loop). Raises QueueFull.
        With `num_top_logprobs` k > 0 each finished sequence gets `seq.top_logprobs`
        (per completion token the k most likely (id, logprob); see Runner.top_logprobs).
        With a `sink`, the request's events are handed to `sink(request, event)` where they happen (the
        engine thread, with the engine's lock held: it must only queue them) instead of to `events()`:
        the engine core batches a step's events of every request into one message (server.core)."""
        req = Request(uuid.uuid4().hex, seqs, asyncio.get_running_loop(), stream=stream, sink=sink)
        with self._cond:
            if not self.is_running:
                raise EngineStopped("engine is not running")
            self.scheduler.enqueue(req)  # stamps arrived_at (server.metrics: queue time, TTFT, latency)
            for seq in seqs:
                seq.num_top_logprobs = max(num_top_logprobs, 0)
            self._cond.notify_all()
        return req

    def abort_all(self) -> int:
        """Abort every queued and running request (shutdown deadline); returns how many."""
        with self._cond:
            reqs = self.scheduler.requests()
            for req in reqs:
                for seq in self.scheduler.abort(req):
                    self._finish(seq)
            self._cond.notify_all()
        return len(reqs)

    def abort(self, req: Request) -> None:
        """Cancel a request's unfinished sequences (client gone); their slots are freed."""
        with self._cond:
            if req.is_finished:
                return
            for seq in self.scheduler.abort(req):
                self._finish(seq)
            self._cond.notify_all()

    async def wait(self, req: Request) -> list[ServerSequence]:
        """Wait for every sequence of `req`; returns them in request order (RequestExpired past its deadline)."""
        return await wait_request(req, lambda: RequestExpired(req.expired, req.deadline_status))

    def events(self, req: Request) -> AsyncIterator[EngineEventTuple]:
        """(kind, seq index, payload) events until every sequence is done or failed (request_events)."""
        return request_events(req)

    # ------------------------------------------------------------------ pause / resume
    async def pause(self, abort_inflight: bool = False, timeout: float | None = None) -> None:
        """Stop admission and wait until nothing runs (aborting running sequences if asked):
        on a future the engine thread resolves once drained. TimeoutError after `timeout` s."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._state is EngineState.RUNNING:
                self._state = EngineState.PAUSED
            if abort_inflight:
                self.scheduler.abort_running()
            self._cond.notify_all()
            if self._is_drained():
                return
            drained = loop.create_future()
            self._drain_waiters.append((loop, drained))
        try:
            await asyncio.wait_for(drained, timeout)
        except TimeoutError:
            raise TimeoutError(f"engine did not drain within {timeout}s") from None
        finally:
            with self._cond:
                if (loop, drained) in self._drain_waiters:
                    self._drain_waiters.remove((loop, drained))

    async def resume(self) -> None:
        with self._cond:
            if self._state is EngineState.PAUSED:
                self._state = EngineState.RUNNING
            self._cond.notify_all()

    async def apply_update(self, version: int, copy: Callable[[], T],
                           drain: Callable[[], Awaitable[None]] | None = None) -> T:
        """The one way the served weights and version change: pause (drain) -> copy -> version -> resume.

        `drain` pauses the engine under the caller's policy (bounded waits, aborting in-flight
        sequences; default `pause()`); `copy()` then writes the weights in a worker thread
        while nothing runs, and only once it returned is the version set. A failed drain or
        copy leaves the version as it was. The engine resumes either way, unless it was
        paused before (an admin's pause stays). Returns what `copy` returned.
        """
        was_paused = self.is_paused
        try:
            await (drain() if drain is not None else self.pause())
            result = await asyncio.to_thread(copy)
            self._version = version
            return result
        finally:
            if not was_paused:
                await self.resume()

    @property
    def is_drained(self) -> bool:
        with self._cond:
            return self._is_drained()

    def _is_drained(self) -> bool:
        """(lock held) Nothing runs, nothing waits to be released, the runner has heard of every sequence that
        left (it may still drop their state) -- so no forward, nor anything of the runner's, is in flight."""
        return ((self.scheduler.is_idle and not self.scheduler.has_left and not self._num_calls_running)
                or not self.is_running)

    def _wake_drained(self) -> None:
        """(lock held) Resolve the pause() calls waiting for the drain, if it is drained now."""
        if not self._drain_waiters or not self._is_drained():
            return
        for loop, drained in self._drain_waiters:
            try:
                loop.call_soon_threadsafe(_resolve, drained)
            except RuntimeError:  # that event loop is closed: its pause() is gone
                pass
        self._drain_waiters.clear()

    def call_between_steps(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn()` on the engine thread between two decode steps (call from an event loop): the
        weights and `version` stay fixed while it runs (never while paused; an update's drain waits
        for it). Returns a future of its result (or its exception). EngineStopped if not running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cond:
            if not self.is_running:
                raise EngineStopped("engine is not running")
            self._calls.append(_BetweenSteps(fn, loop, future))
            self._cond.notify_all()
        return future

    def _run_calls(self, calls: list[_Pending]) -> None:
        for call in calls:
            call.run()
        with self._cond:
            self._num_calls_running = 0
            self._wake_drained()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except Exception as e:  # pragma: no cover - a bug; fail loudly, fail pending requests, stop
            log.exception("engine loop crashed")
            with self._cond:
                self._state = EngineState.STOPPED
                pending = self.scheduler.take_all()
            self._fail(pending, f"engine stopped: {type(e).__name__}: {e}")

    def _iterate(self) -> bool:
        """One engine step: schedule -> run -> post-process; False once the engine is stopped."""
        batch = self._schedule()  # waits for work; None once stopped
        if batch is None or not batch.running:
            return batch is not None
        t0 = time.perf_counter()
        out = self._forward(batch)  # None: the forward raised (its sequences failed)
        if out is not None:
            ended = self.scheduler.postprocess(batch, out, time.monotonic())
            self._deliver(batch, out, ended, t0)
        return True

    def _forward(self, batch: ScheduledBatch) -> StepOutput | None:
        """The runner's step; if it raises, every sequence of the batch fails with the reason."""
        try:
            return self.backend.run(batch)
        except Exception as e:
            log.exception("engine step failed; failing %d sequences", len(batch.running))
            self._fail(batch.running, f"engine step failed: {type(e).__name__}: {e}")
            return None

    def _schedule(self) -> ScheduledBatch | None:
        """Wait for work, then the scheduler's batch; hand back the sequences it aborted (None: stopped)."""
        with self._cond:
            while (self._state is not EngineState.STOPPED and not self.scheduler.has_work(self.is_paused)
                   and not (self._calls and not self.is_paused)):
                self._cond.wait()
            if self._state is EngineState.STOPPED:
                return None
            calls, self._calls = ([], self._calls) if self.is_paused else (self._calls, [])
            self._num_calls_running = len(calls)
            batch = self.scheduler.schedule(paused=self.is_paused, version=self.version, now=time.monotonic())
            self.backend.release(batch.left)  # the one call: every sequence whose pages came back
            for seq in batch.dropped + batch.released:
                self._finish(seq)
            self._wake_drained()
        if calls:  # call_between_steps: between two steps, outside the lock
            self._run_calls(calls)
        return batch

    def _deliver(self, batch: ScheduledBatch, out: StepOutput, ended: list[ServerSequence], t0: float) -> None:
        """After a step: score the top logprobs of the sequences that ended, tell the finish listeners,
        their requests and the streams; then the step listeners."""
        self._score_top_logprobs(ended)
        for hook in self._finish_listeners if ended else ():
            try:
                hook(ended)
            except Exception:  # a recording bug must not stop decoding
                log.exception("finish listener %r failed", hook)
        stats = StepStats(len(batch.running), out.num_committed, time.perf_counter() - t0, len(batch.admitted),
                          self.scheduler.num_waiting, tuple(batch.running), tuple(batch.admitted),
                          batch.num_cache_refused)
        self._after_step(batch.running, ended)
        for fn in self._listeners:
            try:
                fn(stats)
            except Exception:  # a metrics bug must not stop decoding
                log.exception("step listener %r failed", fn)

    def _score_top_logprobs(self, finished: list[ServerSequence]) -> None:
        """Top-k logprobs of finished sequences that asked, while their weights are still served."""
        for seq in finished:
            if seq.num_top_logprobs and seq.completion_ids and not seq.error:
                try:
                    seq.top_logprobs = self.backend.top_logprobs(seq, seq.num_top_logprobs)
                except Exception:  # one request's scoring must not fail the batch
                    log.exception("top logprobs of sequence %s failed", seq.seq_id)

    def _after_step(self, batch: list[ServerSequence], finished: list[ServerSequence]) -> None:
        with self._cond:
            self.num_steps += 1
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            for seq in finished:
                self._finish(seq)
            for seq in batch:
                req = self.scheduler.request_of(seq)
                if req is not None and req.stream and not seq.is_finished:
                    self._emit_update(req, seq)
            self._cond.notify_all()
            self._wake_drained()

    def _emit_update(self, req: Request, seq: ServerSequence) -> None:
        num = len(seq.completion_ids)
        if num > self._emitted.get(seq.seq_id, 0):
            self._emitted[seq.seq_id] = num
            req.emit((EngineEvent.UPDATE, req.index_of[seq.seq_id], (list(seq.completion_ids), seq.text)))

    def _finish(self, seq: ServerSequence) -> None:
        """Hand a finished/aborted sequence back to its request (lock held)."""
        self._emitted.pop(seq.seq_id, None)
        self.num_aborted += seq.finish_reason == FinishReason.ABORT
        req = self.scheduler.finish(seq)
        if req is not None:  # a sequence the runner failed alone (seq.error) fails its own request only
            index = req.index_of[seq.seq_id]
            req.emit((EngineEvent.ERROR, index, seq.error) if seq.error else (EngineEvent.DONE, index, None))

    def _fail(self, batch: list[ServerSequence], message: str) -> None:
        with self._cond:
            for seq, req in self.scheduler.fail(batch):
                req.emit((EngineEvent.ERROR, req.index_of[seq.seq_id], message))
            self._cond.notify_all()
            self._wake_drained()


class _Pending(Protocol):
    def run(self) -> None: ...
    def settle(self, result: None, error: BaseException) -> None: ...


@dataclass(eq=False)
class _BetweenSteps(Generic[T]):
    """One call_between_steps: `fn`, run on the engine thread; its future, settled on the caller's loop."""

    fn: Callable[[], T]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]

    def run(self) -> None:
        try:
            result, error = self.fn(), None
        except Exception as e:  # the caller's failure, not the engine's
            result, error = None, e
        self.settle(result, error)

    def settle(self, result: T | None, error: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # that event loop is closed: its caller is gone
            pass


def _settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> None:
    """(on the caller's event loop) a call_between_steps finished: `result` is fn's unless `error`."""
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(cast(T, result))


def _resolve(drained: asyncio.Future) -> None:
    """(on the pause() caller's event loop) the engine drained."""
    if not drained.done():
        drained.set_result(None)
