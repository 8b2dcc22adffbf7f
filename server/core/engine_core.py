"""EngineCore: the engine's side of the channel -- the model, KV cache, scheduler, runner and weight receiver.

    core = EngineCore(engine, config, model_path)     # an Engine built as `dlrl serve` builds it
    await core.serve("ipc:///tmp/dlrl-serve-x/core.sock", on_ready)   # until core.stop()

It runs where the step loop has its interpreter to itself (server.core.process: its own process; or
server.core.thread: a thread of the API process, for tests and `server.engine_core=thread`). Its event
loop only moves messages (server.core.messages) between the API processes and the Engine:
- `Hello` -> `Welcome` (the served model's facts, the load); the API process's pid is watched: when
  it exits, its requests are aborted (their slots and pages freed) and the core serves the others;
- `Submit` -> the runner builds and checks the sequences (a `Reply` with the refusal: a field, a full
  queue with its Retry-After, a stopped engine), the engine queues them with the Outbox as their sink:
  a step's events of every request go back as one `Outputs` per API process (server.core.outbox);
- `Abort`, `AbortAll`, `Pause`, `Resume`, `SetModelName`, `Score` (prompt log-likelihoods between two
  steps), `Metrics` (its families and the other API processes' last ones, server.core.families);
- the weight-sync control plane (`Weights`: connect, begin, commit, abort, rollback, queries) through
  the same WeightUpdates as ever (server.weights.weight_updates): shm regions are mapped, dist groups
  joined and CUDA-IPC handles opened here, where the model is, with the run's ownership rules as
  they are; the http data plane's buckets arrive as `BucketOpen` (ownership checked before a byte),
  `BucketData` chunks copied once into the staging buffer as they come, `BucketEnd` (verified).
Every `HEARTBEAT_S` without other traffic each API process gets the load (`Outputs` with no events).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio
from pydantic import BaseModel

from dllm.errors import FieldError, TooLong
from dllm.sampling_params import SamplingParams
from server.config import ServerConfig
from server.core import messages as m
from server.core.channel import bind_core
from server.core.families import to_wire
from server.core.lifelines import watch_pid
from server.core.outbox import Outbox
from server.engine.engine import Engine, EngineStopped, QueueFull
from server.engine.retry_after import Forecast
from server.engine.scheduler import Request
from server.engine.sequence import ServerSequence
from server.metrics import ServerMetrics
from server.weights.control import describe_error
from server.weights.weight_updates import make_updates
from weight_sync.errors import UpdateFailed

if TYPE_CHECKING:
    from dllm.scores import TokenScores
from weight_sync.protocol import (
    AbortRequest,
    BeginRequest,
    BucketResponse,
    CommitRequest,
    ConnectRequest,
    RollbackRequest,
)

log = logging.getLogger("dlrl.server")
HEARTBEAT_S = 0.2
FORECAST_EVERY_S = 0.1
RENEW_BYTES = 16 << 20  # the http data plane renews the update's lease every this many bytes


@dataclass(eq=False)
class Peer:
    """One connected API process."""

    identity: bytes
    pid: int
    index: int
    reqs: dict[int, Request] = field(default_factory=dict)
    families: list[m.Family] = field(default_factory=list)  # its last MetricsPush
    last_sent: float = 0.0
    unwatch: Callable[[], None] | None = None


@dataclass(eq=False)
class BucketStream:
    """One PUT /weights/bucket body arriving chunk by chunk."""

    open: m.BucketOpen
    view: memoryview  # the staging buffer's bytes
    pos: int = 0
    overflow: bool = False
    next_renew: int = RENEW_BYTES


def facts_of(engine: Engine, max_queue_tokens: int, model_path: str) -> m.Facts:
    r, kv = engine.backend, engine.scheduler.kv
    info = engine.info  # the runner's declaration (server.engine.backends.base.RunnerInfo)
    runner = m.RunnerFacts(name=str(r.name), block_size=int(r.block_size), vocab_size=int(r.vocab_size),
                           mask_token_id=int(r.mask_token_id), max_batch=int(r.max_batch), max_len=int(r.max_len),
                           has_top_logprobs=info.has_top_logprobs, family=info.family, cache_mode=info.cache_mode,
                           has_likelihoods=info.has_likelihoods, prefix_sharing=info.prefix_sharing,
                           weights=info.weights, note=info.note)
    model = engine.model
    return m.Facts(model_path=model_path, runner=runner, max_model_len=engine.max_model_len,
                   max_queue=engine.scheduler.max_queue, max_queue_tokens=max_queue_tokens, kv_num_slots=kv.num_slots,
                   kv_num_pages=kv.num_pages, kv_page_tokens=kv.page_tokens, kv_optimistic=kv.optimistic,
                   attention="block" if info.family == "sdar" else "full",  # declared, not probed
                   dtype=str(getattr(model, "dtype", "?")), core_pid=os.getpid())


def sampling_params(p: m.Params) -> SamplingParams:
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          strategy=p.strategy, steps=p.steps, threshold=p.threshold, seed=p.seed, stop=list(p.stop),
                          stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos, logit_bias=p.logit_bias)


def error_of(e: BaseException) -> m.Error:
    """A refusal of a request as the client raises it again (server.core.client)."""
    if isinstance(e, FieldError):
        return m.Error("too_long" if isinstance(e, TooLong) else "field", e.message, e.field)
    if isinstance(e, QueueFull):
        return m.Error("queue_full", str(e), retry_after=e.retry_after)
    if isinstance(e, EngineStopped):
        return m.Error("stopped", str(e))
    status, message = describe_error(e)
    return m.Error("http", message, status=status)


class EngineCore:
    def __init__(self, engine: Engine, config: ServerConfig, model_path: str = ""):
        self.engine, self.config, self.model_path = engine, config, model_path
        engine.scheduler.post.text_for_stops_only = True  # the API processes detokenise what they send
        self.metrics = ServerMetrics(engine)
        self.pool = ThreadPoolExecutor(config.weight_threads, thread_name_prefix="dlrl-weights")
        self.updates = make_updates(engine, config, metrics=self.metrics, executor=self.pool)
        self.facts = facts_of(engine, engine.scheduler.max_queue_tokens, model_path)
        self.peers: dict[bytes, Peer] = {}
        self.buckets: dict[tuple[bytes, int], BucketStream] = {}
        self._tasks: set[asyncio.Task] = set()
        self._forecast: tuple[float, Forecast | None] = (0.0, None)
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, address: str, on_ready: Callable[[], None] | None = None) -> None:
        """Bind `address`, start the engine, serve until `stop()`; then shut the engine down (what runs is
        aborted: its requests hear it) and close the receiver."""
        from weight_sync.transports.shm import sweep

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        ctx = zmq.asyncio.Context()
        self.sock = bind_core(ctx, address)
        self.outbox = Outbox(self._loop, self._send_outputs, self.load, self._ended)
        self.engine.add_step_listener(self.outbox.stepped)
        sweep()  # shared-memory regions left by pushers that died
        self.engine.start()
        self.updates.start_capture()  # keep the starting version for rollback
        receiver = asyncio.ensure_future(self._receive())
        heartbeat = asyncio.ensure_future(self._heartbeat())
        if on_ready is not None:
            on_ready()
        try:
            await self._stop.wait()
        finally:
            for task in (receiver, heartbeat, *self._tasks):
                task.cancel()
            await self._shutdown()
            self.sock.close(linger=200)  # the last outputs still go out
            ctx.term()

    def stop(self) -> None:
        """Stop serving (thread-safe; from a signal handler, the loop's own `call_soon_threadsafe`)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)  # waiting and running sequences end (abort)
        self.outbox.flush()
        for peer in list(self.peers.values()):
            if peer.unwatch is not None:
                peer.unwatch()
        self.updates.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        log.info("engine core stopped")

    # ------------------------------------------------------------------ the channel
    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            ident = frames[0].bytes
            try:
                msg = m.decode_to_core(frames[1].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("engine core: a malformed message from %r dropped: %s", ident, e)
                continue
            try:
                self._dispatch(ident, msg, frames[2:])
            except Exception:  # one bad message must not stop the core
                log.exception("engine core: handling %s from %r failed", type(msg).__name__, ident)

    def _send(self, ident: bytes, msg: msgspec.Struct, *extra: bytes) -> None:
        self.sock.send_multipart([ident, m.encode(msg), *extra], copy=False)
        peer = self.peers.get(ident)
        if peer is not None:
            peer.last_sent = time.monotonic()

    def _send_outputs(self, ident: bytes, out: m.Outputs) -> None:
        self._send(ident, out)

    def _reply(self, ident: bytes, cid: int, value: object = None, error: m.Error | None = None) -> None:
        self._send(ident, m.Reply(cid, msgspec.Raw(m.encode(value)), error))

    def _spawn(self, ident: bytes, cid: int, coro: Awaitable[object]) -> None:
        """Run a call; its value (or its failure, described) is the reply."""
        async def run() -> None:
            try:
                value = await coro
            except Exception as e:
                self.broadcast()
                self._reply(ident, cid, error=error_of(e))
            else:
                self.broadcast()  # a call may change the version, the pause or the name: before its reply
                self._reply(ident, cid, value)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dispatch(self, ident: bytes, msg: m.ToCore, extra: list[zmq.Frame]) -> None:
        if isinstance(msg, m.BucketData):
            self._bucket_data(ident, msg, extra)
            return
        if isinstance(msg, m.Hello):
            self._hello(ident, msg)
            return
        peer = self.peers.get(ident)
        if peer is None:  # a process the core forgot (it was restarted, or never said hello): ignore it
            log.warning("engine core: %s from unknown API process %r ignored", type(msg).__name__, ident)
        elif isinstance(msg, m.Goodbye):
            self._peer_gone(peer, "stopped", quiet=True)
        elif isinstance(msg, m.Submit):
            self._submit(peer, msg)
        elif isinstance(msg, m.Abort):
            req = peer.reqs.get(msg.rid)
            if req is not None:
                self.engine.abort(req)
        elif isinstance(msg, m.MetricsPush):
            peer.families = msg.families
        elif isinstance(msg, m.Metrics):
            self._reply(ident, msg.cid, self._families(peer))
        elif isinstance(msg, m.BucketOpen):
            self._bucket_open(peer, msg)
        else:
            self._spawn(ident, msg.cid, self._call(peer, msg))

    async def _call(self, peer: Peer, msg: m.ToCore) -> object:
        engine = self.engine
        if isinstance(msg, m.AbortAll):
            reqs = [r for r in peer.reqs.values() if not r.is_finished]
            for req in reqs:
                engine.abort(req)
            return len(reqs)
        if isinstance(msg, m.Pause):
            await engine.pause(abort_inflight=msg.abort_inflight)
            return self._status()
        if isinstance(msg, m.Resume):
            await engine.resume()
            return self._status()
        if isinstance(msg, m.SetModelName):
            engine.model_name = msg.name
            return msg.name
        if isinstance(msg, m.Score):
            return await self._score(msg)
        if isinstance(msg, m.Weights):
            return await self._weights(msg)
        if isinstance(msg, m.BucketEnd):
            return await self._bucket_end(peer, msg)
        raise ValueError(f"unexpected message {type(msg).__name__}")

    # ------------------------------------------------------------------ API processes
    def _hello(self, ident: bytes, msg: m.Hello) -> None:
        old = self.peers.get(ident)
        if old is not None:
            self._peer_gone(old, f"replaced by process {msg.pid}")
        peer = self.peers[ident] = Peer(ident, msg.pid, msg.index)
        loop = asyncio.get_running_loop()
        if msg.pid != os.getpid():  # a thread of this process (engine_core=thread) cannot die apart
            peer.unwatch = watch_pid(loop, msg.pid, lambda: self._peer_gone(peer, "exited"))
        log.info("engine core: API process %d (pid %d) connected", msg.index, msg.pid)
        self._send(ident, m.Welcome(msg.cid, self.facts, self.load()))

    def _peer_gone(self, peer: Peer, why: str, quiet: bool = False) -> None:
        """An API process is gone: abort its requests (their cache freed), release its buckets, forget it."""
        if self.peers.get(peer.identity) is not peer:
            return
        del self.peers[peer.identity]
        if peer.unwatch is not None:
            peer.unwatch()
        self.outbox.drop_peer(peer.identity)
        live = [r for r in peer.reqs.values() if not r.is_finished]
        for req in live:
            self.engine.abort(req)
        for key in [k for k in self.buckets if k[0] == peer.identity]:
            self._release(self.buckets.pop(key))
        log.log(logging.INFO if quiet else logging.WARNING, "engine core: API process %d (pid %d) %s: %d "
                "request(s) aborted, serving the others", peer.index, peer.pid, why, len(live))

    def _ended(self, ident: bytes, rid: int) -> None:
        peer = self.peers.get(ident)
        if peer is not None:
            peer.reqs.pop(rid, None)

    def _submit(self, peer: Peer, msg: m.Submit) -> None:
        try:
            seqs = [self._sequence(spec) for spec in msg.seqs]
            # every request streams inside the core: its API process decodes each committed block's text as the
            # core's stop-string check did (the same chunks give the same text), streamed or not
            req = self.engine.submit(seqs, stream=True, num_top_logprobs=msg.num_top_logprobs, sink=self.outbox.sink)
        except (FieldError, QueueFull, EngineStopped) as e:
            self._reply(peer.identity, msg.rid, error=error_of(e))
            return
        self.outbox.own(req, peer.identity, msg.rid)
        peer.reqs[msg.rid] = req
        self._reply(peer.identity, msg.rid)

    def _sequence(self, spec: m.SeqSpec) -> ServerSequence:
        [seq] = self.engine.make_sequences([spec.prompt_ids], sampling_params(spec.params), 1)
        seq.deadline, seq.deadline_status = spec.deadline, spec.deadline_status
        return seq

    # ------------------------------------------------------------------ load
    def load(self) -> m.Load:
        e, s = self.engine, self.engine.scheduler
        now = time.monotonic()
        full = s.num_waiting * 2 >= s.max_queue or bool(s.max_queue_tokens and s.waiting_tokens * 2 >= s.max_queue_tokens)
        forecast = None
        if full:
            at, forecast = self._forecast
            if forecast is None or now - at > FORECAST_EVERY_S:
                forecast = s.forecast(now)
                self._forecast = (now, forecast)
        return m.Load(now, e.version, str(e.state), str(e.model_name), e.num_running, s.num_waiting, s.waiting_tokens,
                      s.num_free_slots, s.free_pages, forecast)

    def broadcast(self) -> None:
        """The load to every API process now (after a pause, a resume, a new version or name)."""
        load = self.load()
        for ident in list(self.peers):
            self._send(ident, m.Outputs([], load))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S / 4)
            if self.outbox.stale(HEARTBEAT_S / 4):  # the engine thread's events outside a step (a deadline, a
                self.outbox.flush()                  # failed forward): never those of a step being delivered
            now = time.monotonic()
            stale = [p.identity for p in self.peers.values() if now - p.last_sent >= HEARTBEAT_S]
            if stale:
                load = self.load()
                for ident in stale:
                    self._send(ident, m.Outputs([], load))

    def _status(self) -> dict[str, bool | int]:
        e = self.engine
        return {"is_paused": e.is_paused, "version": e.version, "num_running": e.num_running,
                "num_waiting": e.num_waiting}

    def _families(self, asker: Peer) -> list[list[m.Family]]:
        """The core's families, then each other API process's last pushed ones."""
        return [to_wire(self.metrics.families(engine_part=True))] + [
            p.families for p in self.peers.values() if p is not asker and p.families]

    # ------------------------------------------------------------------ calls that run between steps
    async def _score(self, msg: m.Score) -> tuple[list[m.Scored], int]:
        from dllm.likelihood import prompt_logprobs

        engine, model = self.engine, self.engine.model

        def job(ids: list[int]) -> Callable[[], tuple[TokenScores, int]]:
            return lambda: (prompt_logprobs(model, [ids], msg.method, top_k=msg.top_k, num_samples=msg.num_samples,
                                            seed=msg.seed)[0], engine.version)

        results = await asyncio.gather(*[engine.call_between_steps(job(ids)) for ids in msg.prompts])
        scores = [(list(s.logprobs), s.top, s.num_rows, s.stderr, s.num_samples) for s, _ in results]
        return scores, max((v for _, v in results), default=engine.version)

    async def _weights(self, msg: m.Weights) -> bytes:
        """A weight call's answer as JSON (RemoteWeights validates it into the route's model)."""
        return (await self._weight_call(msg)).model_dump_json().encode()

    async def _weight_call(self, msg: m.Weights) -> BaseModel:
        u, body = self.updates, msg.body
        match msg.op:
            case "connect":
                return await u.connect(ConnectRequest.model_validate_json(body))
            case "begin":
                return await u.begin(BeginRequest.model_validate_json(body))
            case "commit":
                c = CommitRequest.model_validate_json(body)
                return await u.commit(c.version, c.checksums, c.abort_inflight, c.run_id)
            case "abort":
                a = AbortRequest.model_validate_json(body)
                return await u.abort(a.version, a.reason, a.run_id)
            case "rollback":
                r = RollbackRequest.model_validate_json(body)
                return await u.rollback(r.version, r.abort_inflight)
            case "status":
                return await u.status()
            case "state":
                return await u.state(int(msgspec.json.decode(body)))
            case "checksum":
                return await u.checksum()
            case "kept":
                return await u.kept_status()
        raise ValueError(f"unknown weight call {msg.op!r}")

    # ------------------------------------------------------------------ http data plane
    def _bucket_open(self, peer: Peer, msg: m.BucketOpen) -> None:
        try:
            buf = self.updates.open_bucket(msg.index, msg.version, msg.run_id)  # NotOwner before a byte
        except Exception as e:
            self._reply(peer.identity, msg.cid, error=error_of(e))
            return
        self.buckets[(peer.identity, msg.sid)] = BucketStream(msg, buf.numpy().data)  # the bytes of [nbytes] uint8
        self._reply(peer.identity, msg.cid)

    def _bucket_data(self, ident: bytes, msg: m.BucketData, extra: list[zmq.Frame]) -> None:
        st = self.buckets.get((ident, msg.sid))
        if st is None or not extra or st.overflow:
            return
        chunk = extra[0].buffer
        n = len(chunk)
        if st.pos + n > len(st.view):
            st.overflow = True
            return
        st.view[st.pos:st.pos + n] = chunk  # the one copy: into the staging buffer
        st.pos += n
        if st.pos >= st.next_renew:
            self.updates.receiver.touch()
            st.next_renew = st.pos + RENEW_BYTES

    async def _bucket_end(self, peer: Peer, msg: m.BucketEnd) -> bytes:
        st = self.buckets.pop((peer.identity, msg.sid), None)
        if st is None:
            raise UpdateFailed(f"bucket stream {msg.sid} is unknown (never opened, or already ended)")
        o = st.open
        if not msg.ok or st.overflow:
            self._release(st)
            if st.overflow:
                raise UpdateFailed(f"body is longer than the bucket's {len(st.view)} bytes")
            return BucketResponse(index=o.index, nbytes=0).model_dump_json().encode()
        done = await self.updates.bucket_done(o.index, st.pos, o.checksum, o.version, o.run_id)
        return done.model_dump_json().encode()

    def _release(self, st: BucketStream) -> None:
        o = st.open
        try:
            self.updates.receiver.bucket_written(o.index, None, None, o.version, o.run_id)
        except Exception as e:  # the update is gone already (aborted, lease lapsed)
            log.info("bucket %d released after its update ended: %s", o.index, e)


__all__ = ["EngineCore", "Peer", "error_of", "facts_of", "sampling_params"]
