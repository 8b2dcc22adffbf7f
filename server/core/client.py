"""CoreClient: an API process's engine -- the Engine's surface that server.api uses, over the channel.

    client = CoreClient(address, index=0, core_pid=pid)      # server.api.app builds it
    await client.connect()                                   # Hello -> Welcome: the served model's facts
    seqs = client.make_sequences([[5, 6, 7]], params, n=4)   # checked here (400 / 413 before anything is sent)
    req = await client.submit(seqs, stream=True)             # the core's answer: QueueFull (429), EngineStopped
    async for kind, index, payload in client.events(req): ... # as Engine.events: UPDATE / DONE / ERROR
    await client.wait(req); client.abort(req); await client.pause(); await client.score(...)

The sequences the handlers hold are mirrors (server.engine.sequence.ServerSequence) of the engine
core's: made and checked here with the runner's facts, filled in from the core's messages (new ids
of streamed ones per block, everything at the end: trace, error, top log-probabilities, timings).
Their text is decoded HERE, incrementally, with this process's own tokenizer (the core decodes only
what stop strings need): detokenisation happens in the API processes. The load the core sends with
every message (version, pause, running / waiting, free slots and pages, the Retry-After forecast)
answers the properties the handlers and the gate read, without a round trip.

If the core dies (`core_pid` exits, or its thread ends), every request waiting on it fails with
`CoreGone` (a 503 naming the reason), new ones are refused 503, and `on_core_exit(reason)` is told
(the API process then exits non-zero: server.core.process).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from dllm.detokenize import TextStream
from dllm.errors import FieldError, TooLong
from dllm.intake import Intake
from dllm.sampling_params import SamplingParams
from dllm.trace import FinishReason, Trace
from rollout_client.protocol.service import ProcessHealth
from server.core import messages as m
from server.core.channel import connect_api
from server.core.lifelines import watch_pid
from server.engine.backends.base import RunnerInfo
from server.engine.engine import (
    EngineEvent,
    EngineStopped,
    QueueFull,
    RequestExpired,
    request_events,
    wait_request,
)
from server.engine.readout import EngineReadout, EngineState
from server.engine.retry_after import Forecast, RetryAfter
from server.engine.scheduler import KVBudget
from server.engine.sequence import SeqStatus, ServerSequence, samples
from weight_sync.errors import WeightSyncError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # no types to mypy: it does not follow transformers

    from dllm.plain_tokenizer import PlainTokenizer
    from dllm.scores import Method
    from server.engine.engine import EngineEventTuple

log = logging.getLogger("dlrl.server")
CONNECT_TIMEOUT_S = 120.0


class CoreGone(RequestExpired):
    """The engine core died under a request (HTTP 503 naming why; Retry-After)."""

    def __init__(self, message: str):
        super().__init__(message, 503)


class CoreCallFailed(WeightSyncError):
    """A call the engine core answered with a failure; `http_status` as the core mapped it."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.http_status = status


def raise_error(e: m.Error) -> None:
    if e.kind == "too_long":
        raise TooLong(e.field or "prompt", e.message)
    if e.kind == "field":
        raise FieldError(e.field or "prompt", e.message)
    if e.kind == "queue_full":
        raise QueueFull(e.message, e.retry_after)
    if e.kind == "stopped":
        raise EngineStopped(e.message)
    raise CoreCallFailed(e.message, e.status or 400)


def params_of(p: SamplingParams) -> m.Params:
    return m.Params(p.max_tokens, float(p.temperature), p.top_k, float(p.top_p), str(p.strategy), p.steps,
                    float(p.threshold), p.seed, list(p.stop), p.stop_token_ids, p.ignore_eos, p.logit_bias)


@dataclass(eq=False)
class RemoteRequest:
    """A request submitted to the engine core; its events arrive on `events` (as Engine.events reads them)."""

    rid: int
    seqs: list[ServerSequence]
    stream: bool = False  # UPDATE events go to `events` (the mirrors get every committed block either way)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_done: int = 0
    expired: str = ""
    deadline_status: int = 0
    aborted: bool = False

    @property
    def is_finished(self) -> bool:
        return self.num_done >= len(self.seqs)


class _Door(Intake):
    """The runner's checks of a prompt and its parameters (dllm.intake), with the core's facts."""

    def __init__(self, f: m.RunnerFacts):
        self.vocab_size, self.block_size, self.mask_id, self.max_len = f.vocab_size, f.block_size, f.mask_token_id, f.max_len


@dataclass
class ModelConfigView:
    vocab_size: int
    mask_token_id: int


@dataclass
class ModelView:
    """What handlers read of `engine.model` (server.api.likelihood)."""

    config: ModelConfigView
    attention: str
    dtype: str


class QueueView:
    """What handlers and the gate read of `engine.scheduler`, from the core's facts and last load."""

    def __init__(self, client: CoreClient):
        self._c = client
        f = client.facts
        self.max_queue, self.max_queue_tokens = f.max_queue, f.max_queue_tokens
        self.kv = KVBudget(f.kv_num_slots, f.kv_num_pages, f.kv_page_tokens, f.kv_optimistic)
        self.retry = RetryAfter()  # this process's bookings, on the core's forecast

    @property
    def num_waiting(self) -> int:
        return self._c.load.num_waiting

    @property
    def waiting_tokens(self) -> int:
        return self._c.load.waiting_tokens

    @property
    def num_free_slots(self) -> int:
        return self._c.load.num_free_slots

    @property
    def free_pages(self) -> int:
        return self._c.load.free_pages

    def retry_after(self, excess_seqs: int, excess_tokens: int) -> int:
        """Seconds until a request refused here fits (server.engine.retry_after), from the core's forecast."""
        load, now = self._c.load, time.monotonic()
        forecast = load.forecast or Forecast(load.at)  # no forecast: the queue is short, 1 s per place
        return self.retry.estimate(excess_seqs, excess_tokens, forecast, now)


class CoreClient(EngineReadout):
    def __init__(self, address: str, index: int = 0, *, core_pid: int | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 trust_remote_code: bool = False, on_core_exit: Callable[[str], None] | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT_S):
        self.address, self.index, self.core_pid, self.connect_timeout = address, index, core_pid, connect_timeout
        self.trust_remote_code, self.on_core_exit = trust_remote_code, on_core_exit
        self.tokenizer: PreTrainedTokenizerBase | PlainTokenizer | None = tokenizer
        self._detok: PreTrainedTokenizerBase | PlainTokenizer | None = None
        self.dead = ""  # why the engine core is gone ("" while it serves)
        self.facts: m.Facts  # the served model and engine (connect)
        self.load: m.Load    # the core's last load
        self.backend: m.RunnerFacts  # as engine.backend is read: name, block_size, vocab_size, mask_token_id, ...
        self.scheduler: QueueView    # as engine.scheduler is read: max_queue, num_waiting, retry_after, kv, ...
        self.model: ModelView        # as engine.model is read: config.vocab_size / mask_token_id, attention, dtype
        self._ids = itertools.count(1)
        self._reqs: dict[int, RemoteRequest] = {}
        self._calls: dict[int, asyncio.Future[m.Reply]] = {}
        self._finish_listeners: list[Callable[[list[ServerSequence]], None]] = []
        self._tasks: list[asyncio.Future[None]] = []
        self._unwatch: Callable[[], None] | None = None

    # ------------------------------------------------------------------ connection
    async def connect(self, timeout: float | None = None) -> None:
        """Say hello to the core (queued until it listens) and learn the served model (its facts), load this
        process's tokenizer."""
        timeout = self.connect_timeout if timeout is None else timeout
        self._ctx = zmq.asyncio.Context()
        self._sock = connect_api(self._ctx, self.address, self.index)
        self._tasks.append(asyncio.ensure_future(self._receive()))
        loop = asyncio.get_running_loop()
        if self.core_pid is not None:
            self._unwatch = watch_pid(loop, self.core_pid, lambda: self.core_gone(
                f"the engine core process (pid {self.core_pid}) exited"))
        cid = next(self._ids)
        welcome = await asyncio.wait_for(self._call(m.Hello(cid, os.getpid(), self.index), cid), timeout)
        self._welcome(m.value(welcome, m.Welcome))

    def _welcome(self, w: m.Welcome) -> None:
        self.facts, self.load = w.facts, w.load
        self.backend = w.facts.runner
        self.scheduler = QueueView(self)
        self.model = ModelView(ModelConfigView(w.facts.runner.vocab_size, w.facts.runner.mask_token_id),
                               w.facts.attention, w.facts.dtype)
        self._door = _Door(w.facts.runner)
        if self.tokenizer is None:
            from dllm.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(w.facts.model_path, trust_remote_code=self.trust_remote_code)
        self._detok = copy.deepcopy(self.tokenizer)  # this loop's own instance (tokenizers are not re-entrant)

    async def close(self) -> None:
        """Tell the core this process leaves (its requests, if any, are aborted), close the channel."""
        if self._unwatch is not None:
            self._unwatch()
        if hasattr(self, "_sock") and not self.dead:
            try:
                await asyncio.wait_for(self._sock.send_multipart([m.encode(m.Goodbye())]), 1.0)
            except (TimeoutError, zmq.ZMQError):
                pass
        for task in self._tasks:
            task.cancel()
        if hasattr(self, "_sock"):
            self._sock.close(linger=0 if self.dead else 500)  # the Goodbye still goes out
            self._ctx.term()

    def core_gone(self, reason: str) -> None:
        """(loop) The engine core died: fail everything waiting on it; new requests get 503."""
        if self.dead:
            return
        self.dead = reason
        log.error("%s: failing %d request(s) in flight", reason, len(self._reqs))
        for req in list(self._reqs.values()):
            req.expired, req.deadline_status = reason, 503
            for i, seq in enumerate(req.seqs):
                if not seq.is_finished:
                    seq.error = reason
                    req.events.put_nowait((EngineEvent.ERROR, i, reason))
        self._reqs.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineStopped(reason))
        self._calls.clear()
        if self.on_core_exit is not None:
            self.on_core_exit(reason)

    # ------------------------------------------------------------------ the Engine's properties
    @property
    def model_name(self) -> str:
        return self.load.model_name

    @property
    def version(self) -> int:
        return self.load.version

    @property
    def info(self) -> RunnerInfo:
        """What the core's runner supports (its declaration, from the core's facts)."""
        f = self.facts.runner
        return RunnerInfo(f.family, f.cache_mode, has_top_logprobs=f.has_top_logprobs,
                          has_likelihoods=f.has_likelihoods, prefix_sharing=f.prefix_sharing, weights=f.weights,
                          note=f.note)

    # is_running, is_paused, num_running, num_waiting, max_model_len: EngineReadout's, from these three and the
    # runner's facts (max_len: the core's max_model_len)
    def _last_state(self) -> str:
        return self.load.state

    def _alive(self) -> bool:
        return not self.dead

    def _counts(self) -> m.Load:
        return self.load

    @property
    def state(self) -> str:
        """The core's last state; "stopped" once the core is gone (is_paused still says what it said last)."""
        return EngineState.STOPPED if self.dead else self.load.state

    def processes(self) -> list[ProcessHealth]:
        """This API process and the engine core, as /health reports them."""
        pid = self.facts.core_pid
        return [ProcessHealth(role="api", pid=os.getpid(), index=self.index),
                ProcessHealth(role="engine_core", pid=pid, alive=not self.dead,
                              mode="thread" if pid == os.getpid() else "process", reason=self.dead or None)]

    def add_finish_listener(self, fn: Callable[[list[ServerSequence]], None]) -> None:
        """`fn(sequences)` with the sequences that ended, before their requests hear of it (the recorder)."""
        self._finish_listeners.append(fn)

    # ------------------------------------------------------------------ requests
    def make_sequences(self, prompts_ids: list[list[int]], params: SamplingParams, n: int = 1) -> list[ServerSequence]:
        """Checked mirrors, prompt-major; sample i of each prompt uses seed + i (when seeded). The core checks again."""
        f = self.facts.runner
        seqs = []
        for ids, p in samples(prompts_ids, params, n):
            self._door.validate(ids, p)
            # a mirror: the engine core makes the sequence that decodes and draws an unseeded one's noise key
            # there, so this one's key is never used (0: no draw, no torch in an API process)
            seqs.append(ServerSequence(ids, p, f.block_size, f.mask_token_id, noise_seed=0))
        return seqs

    async def submit(self, seqs: list[ServerSequence], stream: bool = False, num_top_logprobs: int = 0) -> RemoteRequest:
        """Queue a request's sequences in the core (its answer awaited): QueueFull, EngineStopped, FieldError."""
        if self.dead:
            raise EngineStopped(self.dead)
        rid = next(self._ids)
        req = self._reqs[rid] = RemoteRequest(rid, seqs, stream)
        now = time.monotonic()
        for seq in seqs:
            seq.num_top_logprobs, seq.status, seq.arrived_at = max(num_top_logprobs, 0), SeqStatus.WAITING, now
        specs = [m.SeqSpec(s.prompt_ids, params_of(s.params), s.deadline, s.deadline_status) for s in seqs]
        try:
            await self._call(m.Submit(rid, specs, stream, max(num_top_logprobs, 0)), rid)
        except BaseException as e:
            self._reqs.pop(rid, None)
            if isinstance(e, asyncio.CancelledError) and not self.dead:  # the core may have taken it: undo
                self._send_nowait(m.Abort(rid))
            raise
        return req

    def abort(self, req: RemoteRequest) -> None:
        """Cancel a request's unfinished sequences in the core (client gone); their slots are freed."""
        if req.is_finished or req.aborted or self.dead or req.rid not in self._reqs:
            return
        req.aborted = True
        self._send_nowait(m.Abort(req.rid))

    def abort_all(self) -> int:
        """Abort every request of this API process (shutdown deadline); returns how many."""
        live = [r for r in self._reqs.values() if not r.is_finished]
        if live and not self.dead:
            self._send_nowait(m.AbortAll(next(self._ids)))
        return len(live)

    async def wait(self, req: RemoteRequest) -> list[ServerSequence]:
        """As Engine.wait; past the deadline CoreGone when the core died, else RequestExpired."""
        return await wait_request(req, lambda: CoreGone(req.expired) if self.dead
                                  else RequestExpired(req.expired, req.deadline_status))

    def events(self, req: RemoteRequest) -> AsyncIterator[EngineEventTuple]:
        return request_events(req)

    # ------------------------------------------------------------------ calls
    async def pause(self, abort_inflight: bool = False, timeout: float | None = None) -> None:
        cid = next(self._ids)
        await asyncio.wait_for(self._call(m.Pause(cid, abort_inflight), cid), timeout)

    async def resume(self) -> None:
        cid = next(self._ids)
        await self._call(m.Resume(cid), cid)

    async def set_model_name(self, name: str) -> None:
        cid = next(self._ids)
        await self._call(m.SetModelName(cid, name), cid)

    async def score(self, prompts: list[list[int]], method: Method, top_k: int, num_samples: int,
                    seed: int) -> tuple[list[m.Scored], int]:
        """Prompt log-likelihoods in the core, each prompt between two steps: ([(logprobs, top, rows, stderr,
        samples)], version)."""
        cid = next(self._ids)
        reply = await self._call(m.Score(cid, prompts, method, top_k, num_samples, seed), cid)
        return m.value(reply, tuple[list[m.Scored], int])

    async def core_families(self) -> list[list[m.Family]]:
        """The core's metric families, then the other API processes' last pushed ones."""
        cid = next(self._ids)
        return m.value(await self._call(m.Metrics(cid), cid), list[list[m.Family]])

    def push_families(self, families: list[m.Family]) -> None:
        self._send_nowait(m.MetricsPush(families))

    async def call(self, msg: m.ToCore, cid: int, *extra: bytes) -> m.Reply:
        """Send `msg` (with raw frames `extra`) and await the core's reply to `cid`; its failure raised."""
        return await self._call(msg, cid, *extra)

    async def send(self, msg: m.ToCore, *extra: bytes) -> None:
        """Send `msg` with raw frames (a bucket's chunk); waits while the channel is full (flow control)."""
        if self.dead:
            raise EngineStopped(self.dead)
        await self._sock.send_multipart([m.encode(msg), *extra], copy=False)

    def call_soon(self, msg: m.ToCore, cid: int) -> None:
        """Send a call whose reply nobody waits for (dropped when it comes)."""
        if not self.dead:
            self._send_nowait(msg)

    def next_id(self) -> int:
        return next(self._ids)

    async def _call(self, msg: m.ToCore, cid: int, *extra: bytes) -> m.Reply:
        if self.dead:
            raise EngineStopped(self.dead)
        future: asyncio.Future[m.Reply] = asyncio.get_running_loop().create_future()
        self._calls[cid] = future
        try:
            await self._sock.send_multipart([m.encode(msg), *extra], copy=False)
            reply = await future
        finally:
            self._calls.pop(cid, None)
        if reply.error is not None:
            raise_error(reply.error)
        return reply

    def _send_nowait(self, msg: m.ToCore) -> None:
        self._sock.send_multipart([m.encode(msg)])  # never waits for long: nothing but bucket data fills it

    # ------------------------------------------------------------------ messages from the core
    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg = m.decode_to_api(frames[0].buffer)
            except Exception as e:  # a bug on the other side; never crash the API process for it
                log.error("engine client: a malformed message from the core dropped: %s", e)
                continue
            if isinstance(msg, m.Outputs):
                self.load = msg.load
                for event in msg.events:
                    self._event(event)
            elif isinstance(msg, m.Reply):
                future = self._calls.get(msg.cid)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, m.Welcome):
                future = self._calls.get(msg.cid)
                if future is not None and not future.done():
                    future.set_result(m.Reply(msg.cid, msgspec.Raw(m.encode(msg))))

    def _event(self, ev: m.Event) -> None:
        req = self._reqs.get(ev.rid)
        if req is None or not 0 <= ev.index < len(req.seqs):
            return
        seq = req.seqs[ev.index]
        if isinstance(ev, m.Update):
            self._extend(seq, ev.ids)
            if req.stream:
                req.events.put_nowait((EngineEvent.UPDATE, ev.index, (list(seq.completion_ids), seq.text)))
            return
        if isinstance(ev, m.Done):
            self._finish(seq, ev)
            for fn in self._finish_listeners:
                try:
                    fn([seq])
                except Exception:  # a recording bug must not fail the request
                    log.exception("finish listener %r failed", fn)
            req.events.put_nowait((EngineEvent.ERROR, ev.index, seq.error) if seq.error
                                  else (EngineEvent.DONE, ev.index, None))
        else:
            req.expired, req.deadline_status = ev.expired, ev.deadline_status
            seq.error, seq.status = ev.message, SeqStatus.FINISHED
            if seq.finish_reason is None:
                seq.finish_reason = FinishReason.ABORT
            req.events.put_nowait((EngineEvent.ERROR, ev.index, ev.message))
        req.num_done += 1
        if req.is_finished:
            del self._reqs[req.rid]

    def _extend(self, seq: ServerSequence, ids: list[int]) -> None:
        """New completion ids of a mirror, decoded into its text here (the core does not send text)."""
        if not ids:
            return
        seq.completion_ids += ids
        if self._detok is not None:
            if seq.text_stream is None:
                seq.text_stream = TextStream(self._detok, seq.params.stop)
            seq.text_stream.push(ids)
            seq.text = seq.text_stream.text

    def _finish(self, seq: ServerSequence, ev: m.Done) -> None:
        self._extend(seq, ev.ids)
        t = ev.trace
        seq.trace = Trace.model_construct(
            prompt_len=len(seq.prompt_ids), block_size=seq.block_size, steps=t.steps, logprobs=t.logprobs,
            version=t.version, finish_reason=FinishReason(t.finish_reason) if t.finish_reason else None,
            tail_ids=t.tail_ids, tail_steps=t.tail_steps, cache_mode=t.cache_mode, canvas_len=t.canvas_len,
            trace_free=t.trace_free, backend=t.backend, block_origin=t.block_origin, schedule=t.schedule,
            further_horizon=t.further_horizon, logit_bias=t.logit_bias)
        seq.error, seq.num_forwards, seq.status = ev.error, ev.num_forwards, SeqStatus.FINISHED
        seq.top_logprobs = [list(row) for row in ev.top_logprobs] if ev.top_logprobs is not None else None
        seq.params.stop_token_ids = ev.stop_token_ids
        seq.arrived_at, seq.admitted_at, seq.first_token_at, seq.finished_at = ev.times


__all__ = ["CoreCallFailed", "CoreClient", "CoreGone", "RemoteRequest", "params_of", "raise_error"]
