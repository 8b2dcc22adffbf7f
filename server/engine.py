"""Engine: continuous batching of block-diffusion decoding in one background thread.

    engine = Engine(NativeBackend(model, tokenizer, max_batch=16), max_queue=256)
    engine.start()
    seqs = engine.make_sequences([[5, 6, 7]], SamplingParams(max_tokens=32), n=4)
    req = engine.submit(seqs)              # from an asyncio handler; QueueFull -> 429
    await engine.wait(req)                 # -> the finished Sequences (completion, text, trace)
    await engine.pause(); engine.version += 1; await engine.resume()   # weight update window

Each loop iteration (the Runner side is the backend): release aborted sequences, admit
the waiting ones that fit (`backend.num_admissible`: free slots and KV-cache pages), run
ONE batched denoising forward over every
running sequence -- whatever its prompt, position, block, strategy or sampling params --
then hand finished sequences (and, for streams, newly committed blocks) back to their
requests' event loops. So concurrent requests share every forward. A sequence the backend
failed alone (`seq.error`, e.g. non-finite probabilities) fails only its own request
(`RequestFailed`: the server answers a 500 with its message); the others go on.

`pause()` stops admission and waits until no sequence runs and no forward is in flight
(with `abort_inflight=True` it aborts the running ones first); while paused and drained
nothing touches `engine.model`, so the weight-sync receiver can copy weights into it.
Every sequence is stamped with `version` when admitted; pausing drains before an update,
so a sequence never mixes versions.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from server.backends.base import Backend
from server.logprobs import top_logprobs
from server.scheduler import QueueFull, Request, Scheduler

log = logging.getLogger("dlrl.server")
__all__ = ["Engine", "EngineStopped", "QueueFull", "Request", "RequestExpired", "RequestFailed", "StepStats"]


class EngineStopped(RuntimeError):
    """The engine is shut down (or its thread died); no new requests."""


class RequestFailed(RuntimeError):
    """A sequence of the request failed in the engine; the message says why (the server answers 500)."""


class RequestExpired(RequestFailed):
    """The request ran past its deadline and was aborted; `deadline_status` is the status its deadline was
    set with (`Sequence.deadline_status`, by server.generation: 408 its own timeout, 503 the server's limit)."""

    def __init__(self, message: str, deadline_status: int):
        super().__init__(message)
        self.deadline_status = deadline_status


@dataclass
class StepStats:
    batch_size: int      # sequences in the forward
    num_tokens: int      # tokens committed by it
    seconds: float       # wall time of admission prefill + forward
    num_admitted: int
    num_waiting: int
    seqs: tuple = ()              # the batch (after the forward), for per-sequence latency metrics
    admitted: tuple = ()          # sequences admitted into this forward
    num_cache_refused: int = 0    # waiting sequences a free slot could take but the KV-cache pages could not


class Engine:
    def __init__(self, backend: Backend, *, max_queue: int = 256, model_name: str = "dlrl"):
        self.backend, self.model_name = backend, model_name
        self.version = 0
        self.scheduler = Scheduler(max_queue)
        self.max_batch_seen = 0
        self.num_steps = 0
        self.num_aborted = 0
        self._cond = threading.Condition()
        self._is_paused = self._is_busy = self._stop = False
        self._thread: threading.Thread | None = None
        self._listeners: list[Callable[[StepStats], None]] = []
        self._emitted: dict[int, int] = {}  # seq_id -> completion tokens already streamed
        self._top_k: dict[int, int] = {}    # seq_id -> top logprobs asked for (server.logprobs)

    # ------------------------------------------------------------------ properties
    @property
    def model(self) -> Any:
        return self.backend.model

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.backend.max_len

    @property
    def is_paused(self) -> bool:
        return self._is_paused

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dlrl-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            for seq in list(self.scheduler.waiting) + self.scheduler.running:
                self.backend.release(seq)
                self._finish(seq)
            self.scheduler.waiting.clear()
        self.backend.close()

    # ------------------------------------------------------------------ requests
    def make_sequences(self, prompts_ids: list[list[int]], params: Any, n: int = 1) -> list[Any]:
        """Validated Sequences, prompt-major; sample i of each prompt uses seed + i (when seeded)."""
        seqs = []
        for ids in prompts_ids:
            for i in range(n):
                p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
                seqs.append(self.backend.new_sequence(ids, p))
        return seqs

    def submit(self, seqs: list[Any], stream: bool = False, num_top_logprobs: int = 0) -> Request:
        """Queue the sequences of one request (call from the event loop). Raises QueueFull.
        With `num_top_logprobs` k > 0 each finished sequence gets `seq.top_logprobs`
        (per completion token the k most likely (id, logprob); see server.logprobs)."""
        req = Request(uuid.uuid4().hex, seqs, asyncio.get_running_loop(), stream=stream)
        for seq in seqs:
            seq.arrived_at = req.arrival  # server.metrics: queue time, TTFT, end-to-end latency
        with self._cond:
            if not self.is_running:
                raise EngineStopped("engine is not running")
            self.scheduler.enqueue(req)
            if num_top_logprobs > 0:
                self._top_k.update((s.seq_id, num_top_logprobs) for s in seqs)
            self._cond.notify_all()
        return req

    def abort_all(self) -> int:
        """Abort every queued and running request (shutdown deadline); returns how many."""
        with self._cond:
            reqs = list({id(r): r for r in self.scheduler.owner.values()}.values())
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

    async def wait(self, req: Request) -> list[Any]:
        """Wait for every sequence of `req`; returns them in request order."""
        async for kind, index, payload in self.events(req):
            if kind == "error" and req.expired:
                raise RequestExpired(req.expired, req.deadline_status)
            if kind == "error":
                raise RequestFailed(f"sample {index}: {payload}" if len(req.seqs) > 1 else payload)
        return req.seqs

    async def events(self, req: Request):
        """Yield (kind, seq index, payload) events until every sequence is done or failed.

        kinds: "update" (streams only; payload = (completion ids, text) after a block
        committed), "done" (payload None; read the Sequence), "error" (payload = message).
        """
        num_left = len(req.seqs)
        while num_left:
            event = await req.events.get()
            num_left -= event[0] != "update"
            yield event

    # ------------------------------------------------------------------ pause / resume
    async def pause(self, abort_inflight: bool = False, timeout: float | None = None) -> None:
        """Stop admission and wait until nothing runs (aborting running sequences if asked)."""
        with self._cond:
            self._is_paused = True
            if abort_inflight:
                self.scheduler.abort_running()
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_drained:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"engine did not drain within {timeout}s")
            await asyncio.sleep(0.002)

    async def resume(self) -> None:
        with self._cond:
            self._is_paused = False
            self._cond.notify_all()

    @property
    def is_drained(self) -> bool:
        with self._cond:
            s = self.scheduler
            return not (s.running or s.to_release or self._is_busy) or not self.is_running

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except Exception as e:  # pragma: no cover - a bug; fail loudly, fail pending requests, stop
            log.exception("engine loop crashed")
            self._stop = True
            with self._cond:
                pending = list(self.scheduler.waiting) + self.scheduler.running
                self.scheduler.waiting.clear()
            self._fail(pending, f"engine stopped: {type(e).__name__}: {e}")

    def _iterate(self) -> bool:
        with self._cond:
            while not self._stop and not self.scheduler.has_work(self._is_paused):
                self._cond.wait()
            if self._stop:
                return False
            self._expire()
            for seq in self.scheduler.take_releases():
                self.backend.release(seq)
                self._finish(seq)
            num = 0 if self._is_paused else self.backend.num_admissible(self.scheduler.waiting)
            admitted = [] if self._is_paused else self.scheduler.admit(num)
            refused = 0 if self._is_paused else min(self.scheduler.num_waiting, self.backend.num_free_slots - num)
            now = time.monotonic()
            for seq in admitted:
                seq.trace.version = self.version
                seq.admitted_at = now
            batch = list(self.scheduler.running)
            self._is_busy = bool(batch)
        if not batch:
            return True
        t0 = time.perf_counter()
        try:
            if admitted:
                self.backend.add(admitted)
            before = [len(s.masked_positions()) for s in batch]
            finished = self.backend.step(batch)
            self._score_top_logprobs(finished)
        except Exception as e:
            log.exception("engine step failed; failing %d sequences", len(batch))
            self._fail(batch, f"engine step failed: {type(e).__name__}: {e}")
            return True
        stats = StepStats(len(batch), self._committed(batch, before), time.perf_counter() - t0,
                          len(admitted), self.scheduler.num_waiting, tuple(batch), tuple(admitted), refused)
        self._after_step(batch, finished)
        for fn in self._listeners:
            try:
                fn(stats)
            except Exception:  # a metrics bug must not stop decoding
                log.exception("step listener %r failed", fn)
        return True

    def _score_top_logprobs(self, finished: list[Any]) -> None:
        """Top-k logprobs of finished sequences that asked, while their weights are still served."""
        for seq in finished:
            k = self._top_k.pop(seq.seq_id, 0)
            if k and seq.completion_ids:
                try:
                    seq.top_logprobs = top_logprobs(self.backend.model, seq, k)
                except Exception:  # one request's scoring must not fail the batch
                    log.exception("top logprobs of sequence %s failed", seq.seq_id)

    @staticmethod
    def _committed(batch: list[Any], before: list[int]) -> int:
        return sum(b if (s.is_finished or s.step_in_block == 0) else b - len(s.masked_positions())
                   for s, b in zip(batch, before))

    def _after_step(self, batch: list[Any], finished: list[Any]) -> None:
        with self._cond:
            self._is_busy = False
            self.num_steps += 1
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            for seq in finished:
                self._finish(seq)
            for seq in batch:
                req = self.scheduler.owner.get(seq.seq_id)
                if req is not None and req.stream and not seq.is_finished:
                    self._emit_update(req, seq)
            self._cond.notify_all()

    def _emit_update(self, req: Request, seq: Any) -> None:
        num = len(seq.completion_ids)
        if num > self._emitted.get(seq.seq_id, 0):
            self._emitted[seq.seq_id] = num
            req.emit(("update", req.index_of[seq.seq_id], (list(seq.completion_ids), seq.text)))

    def _expire(self) -> None:
        """Abort the requests past their deadline (lock held): waiting sequences are dropped,
        running ones released (slots and KV pages freed) below; each fails with the reason."""
        for req in self.scheduler.expired(time.monotonic()):
            waited = any(s.slot is None for s in req.seqs if not s.is_finished)
            req.expired = (f"request deadline exceeded after {time.monotonic() - req.arrival:.1f}s (the request's "
                           f"`timeout`, capped by server.max_request_s) "
                           + ("waiting for KV cache pages (prompt + max_tokens = "
                              f"{req.num_tokens} tokens)" if waited else "during generation")
                           + "; aborted, its cache freed")
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.error = req.expired
            for seq in self.scheduler.abort(req):
                self._finish(seq)

    def _finish(self, seq: Any) -> None:
        """Hand a finished/aborted sequence back to its request (lock held)."""
        if seq in self.scheduler.to_release:
            self.scheduler.to_release.remove(seq)
        self._emitted.pop(seq.seq_id, None)
        self._top_k.pop(seq.seq_id, None)
        if seq.trace.finish_reason is None:
            seq.trace.finish_reason = seq.finish_reason
        self.num_aborted += seq.finish_reason == "abort"
        req = self.scheduler.finish(seq)
        if req is not None:  # a sequence the decoder failed alone (seq.error) fails its own request only
            error = getattr(seq, "error", None)
            req.emit(("error", req.index_of[seq.seq_id], error) if error else ("done", req.index_of[seq.seq_id], None))

    def _fail(self, batch: list[Any], message: str) -> None:
        with self._cond:
            self._is_busy = False
            self.scheduler.to_release = [s for s in self.scheduler.to_release if s not in batch]
            for seq in batch:
                self.backend.release(seq)
                self._top_k.pop(seq.seq_id, None)
                req = self.scheduler.finish(seq)
                if req is not None:
                    req.emit(("error", req.index_of[seq.seq_id], message))
            self._cond.notify_all()
