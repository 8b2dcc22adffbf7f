"""Scheduler: owns every sequence of the engine -- its status, its KV slot and pages, its post-processing.

Not thread-safe by itself: the engine calls it while holding its lock (but `postprocess`, which
touches only the batch's sequences and the KV account, both the engine thread's alone). It is
dllm's scheduler (dllm.scheduler: admission, optimistic growth and preemption, and through its block
manager every slot, page table, reference count and cached prompt block) with what a server adds:
requests, their deadlines, bounds on the queue and Retry-After. A `ServerSequence`
(server/engine/sequence.py) moves NEW -> WAITING -> RUNNING -> (RELEASING ->) FINISHED only through
these methods (the engine reads `waiting`, `running`, `is_idle`, never edits them):

    sched = Scheduler(max_queue=256, kv=KVBudget(num_slots=16, num_pages=2048, page_tokens=4),
                      post=runner.postprocessor())
    sched.enqueue(request)                    # -> waiting; QueueFull (with retry_after) when the queue is full
    batch = sched.schedule(paused=False, version=3, now=t)   # one engine step's ScheduledBatch:
        # expired requests aborted (batch.dropped: waiting ones, done), releasing -> out (batch.released),
        # then dllm's schedule: older versions' cached pages retired, growth / preemption (batch.preempted),
        # waiting -> running FIFO while a slot and the KV pages are free (batch.admitted; none while paused
        # but preempted ones); batch.running: the forward's batch; batch.left: every sequence whose pages
        # came back since the last step (the runner drops what it keeps of them: Runner.release)
    finished = sched.postprocess(batch, out, now=t)   # the runner's StepOutput: stop ids, stop strings,
        # max_tokens, finish reason (dllm.postprocess.Postprocessor); ended ones give back slot + pages
    dropped = sched.abort(request)            # waiting -> done (returned); running -> releasing
    sched.abort_running()                     # every running sequence -> releasing (pause with abort)
    req = sched.finish(seq)                   # running / releasing / dropped -> finished; returns its request
    pairs = sched.fail(batch)                 # a failed forward: its sequences -> finished, with their requests
    left = sched.take_all()                   # shutdown: every waiting and running sequence, queue emptied

An invalid transition (enqueueing a sequence twice, finishing one that still waits) raises
`InvalidTransition`: a bug in the caller, never a client's doing.

KV accounting (`KVBudget`, the runner's cache; dllm.block_manager holds the account): a sequence
is admitted only when a slot and the pages of its prompt + max_tokens are free (its cached prompt
blocks aside: shared, not taken); it holds them until it ends, so a running sequence never runs out
of cache mid-generation and nothing is preempted. With `KVBudget(optimistic=True)`
(server.kv_admission=optimistic) a sequence is admitted on the pages its next forward touches and
its account grows block by block; when the running sequences' next blocks do not fit, the newest
ones are preempted (`batch.preempted`: back to the queue's front, slot and pages given back; they
keep their tokens and trace) and re-admitted first, their cache recomputed (vLLM's preemption by
recompute). A preempted sequence keeps its version: while paused, preempted ones are still
re-admitted and the engine is drained only once they finish too. With prefix sharing
(server.prefix_caching, block-causal runners) complete prompt blocks are shared by the samples of a
request and by requests with the same prefix, and kept after their sequences end until their pages
are needed (dllm.block_manager; counters `blocks.num_queried_tokens` / `num_hit_tokens`).

A `Request` groups the sequences of one HTTP request (prompts x n) and carries the
asyncio queue its handler reads events from (filled from the engine thread).

Back-pressure: the queue is bounded in sequences (`max_queue`) and in tokens
(`max_queue_tokens`: prompt + max_tokens of every waiting sequence, what they will need in
KV pages; 0 = unbounded); a request over either bound is refused (429) with a `retry_after`
from the work ahead of it: the tokens the running and waiting sequences have left to decode at the
measured decode rate (server.engine.retry_after.RetryAfter; `forecast()`). A request waits
in the queue until its pages are free, at most until its deadline (`seq.deadline`,
server.api.generation.request_deadline), when `schedule` aborts it (its error names the reason:
503/408, its slots and pages freed).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dllm import scheduler as core
from dllm.block_manager import KVBudget
from dllm.postprocess import Postprocessor, StepOutput
from dllm.scheduler import ScheduledBatch
from dllm.trace import FinishReason
from server.engine.retry_after import Forecast, RetryAfter, Work
from server.engine.sequence import SeqStatus, ServerSequence

if TYPE_CHECKING:
    from server.engine.engine import EngineEventTuple

__all__ = ["InvalidTransition", "KVBudget", "QueueFull", "Request", "ScheduledBatch", "Scheduler", "seq_tokens"]

THROUGHPUT_WINDOW_S = 60.0


class InvalidTransition(RuntimeError):
    """A scheduler transition that the sequence's state does not allow (a bug in the caller)."""


class QueueFull(RuntimeError):
    """The waiting queue cannot take the request's sequences (-> HTTP 429, Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


def seq_tokens(seq: ServerSequence) -> int:
    """What a sequence will hold in the KV cache: prompt + max_tokens."""
    return len(seq.prompt_ids) + int(seq.params.max_tokens)


@dataclass
class Request:
    request_id: str
    seqs: list[ServerSequence]           # prompt-major order (p * n + i)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[EngineEventTuple] = field(default_factory=asyncio.Queue)
    stream: bool = False
    arrival: float = field(default_factory=time.monotonic)
    num_done: int = 0
    is_aborted: bool = False
    expired: str = ""                    # why the request was aborted at its deadline ("" = it was not)
    sink: Callable[[Request, EngineEventTuple], None] | None = None  # events go here (engine thread) instead of `events`

    def __post_init__(self) -> None:
        self.index_of = {s.seq_id: i for i, s in enumerate(self.seqs)}
        deadlines = [s.deadline for s in self.seqs if s.deadline is not None]
        self.deadline: float | None = min(deadlines) if deadlines else None
        self.deadline_status = max((s.deadline_status for s in self.seqs), default=0) or 503
        self.num_tokens = sum(seq_tokens(s) for s in self.seqs)

    @property
    def is_finished(self) -> bool:
        return self.num_done == len(self.seqs)

    def emit(self, event: EngineEventTuple) -> None:
        """Thread-safe: hand an event to the request's handler on its event loop (or to its `sink`, at once)."""
        if self.sink is not None:
            self.sink(self, event)
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # loop closed: the client is gone
            pass


class Scheduler(core.Scheduler[ServerSequence]):
    def __init__(self, max_queue: int, max_queue_tokens: int = 0, *, kv: KVBudget | None = None,
                 post: Postprocessor | None = None):
        """`kv` and `post` come from the runner (Engine); without them (queue bookkeeping alone, tests): as
        many slots as `max_queue`, unpaged, and no stop rules but max_tokens."""
        super().__init__(kv or KVBudget(max_queue),
                         post or Postprocessor(eos_ids=(), tokenizer=None, max_len=sys.maxsize, block_size=1))
        self.max_queue, self.max_queue_tokens = max_queue, max_queue_tokens
        self.waiting_tokens = 0
        self.retry = RetryAfter()  # server.engine.retry_after: Retry-After from the work ahead and the decode rate
        self._finished: deque[tuple[float, int]] = deque()  # (time, tokens) of recently finished sequences
        self._with_deadline: list[tuple[float, Request]] = []  # (its deadline, a request that has one)
        self._releasing: list[ServerSequence] = []  # running sequences aborted by a client, a deadline or pause
        self._owner: dict[int, Request] = {}  # seq_id -> request, until the sequence is done

    # ------------------------------------------------------------------ reading
    @property
    def waiting(self) -> tuple[ServerSequence, ...]:
        """The waiting sequences, oldest first (a snapshot)."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[ServerSequence, ...]:
        """The running sequences: the next forward's batch (a snapshot)."""
        return tuple(self._running)

    @property
    def is_idle(self) -> bool:
        """Nothing runs, nothing waits to be released and no preempted sequence waits to go on (a paused
        engine is then drained)."""
        return not (self._running or self._releasing or self._has_preempted())

    def has_work(self, is_paused: bool) -> bool:
        """A step to take: sequences to run or release, the runner to tell of sequences that left."""
        return bool(self._running or self._releasing or (self._waiting and not is_paused) or self._has_preempted()
                    or self._left)

    def _has_preempted(self) -> bool:
        """A preempted sequence waits (it was admitted once): the front of the queue (they go back there)."""
        return bool(self._waiting) and self._waiting[0].num_preemptions > 0

    def request_of(self, seq: ServerSequence) -> Request | None:
        """The request of a sequence not done yet (None once it is)."""
        return self._owner.get(seq.seq_id)

    def requests(self) -> list[Request]:
        """Every request with a sequence not done yet, in arrival order."""
        return list({id(r): r for r in self._owner.values()}.values())

    # ------------------------------------------------------------------ transitions
    def enqueue(self, req: Request) -> None:
        """NEW -> WAITING, every sequence of the request; QueueFull when the queue cannot take them."""
        excess = len(self._waiting) + len(req.seqs) - self.max_queue
        if excess > 0:
            raise QueueFull(f"queue full: {len(self._waiting)} sequences waiting, request adds {len(req.seqs)} "
                            f"(max_queue={self.max_queue}); retry later", self.retry_after(excess, 0))
        excess_tokens = self.waiting_tokens + req.num_tokens - self.max_queue_tokens
        if self.max_queue_tokens and self._waiting and excess_tokens > 0:
            raise QueueFull(f"queue full: the waiting sequences need {self.waiting_tokens} tokens of KV cache, the "
                            f"request adds {req.num_tokens} (prompt + max_tokens; max_queue_tokens="
                            f"{self.max_queue_tokens}); retry later or lower max_tokens",
                            self.retry_after(0, excess_tokens))
        again = [s.seq_id for s in req.seqs if s.status is not SeqStatus.NEW]
        if again:
            raise InvalidTransition(f"enqueue: sequences {again} are already scheduled")
        for seq in req.seqs:
            self._owner[seq.seq_id] = req
            self.add(seq)
            seq.arrived_at = req.arrival
        self.waiting_tokens += req.num_tokens
        if req.deadline is not None:
            self._with_deadline.append((req.deadline, req))

    def retry_after(self, excess_seqs: int, excess_tokens: int) -> int:
        """Seconds until a refused request fits, `excess` waiting sequences / tokens ahead (server.engine.retry_after)."""
        now = time.monotonic()
        return self.retry.estimate(excess_seqs, excess_tokens, self.forecast(now), now)

    def forecast(self, now: float) -> Forecast:
        """When the waiting sequences leave the queue, from the work ahead (server.engine.retry_after)."""
        share = self.retry.share()
        kv = self.blocks.budget  # the block manager's: pages held are the sequence's page table
        running = [Work(self.retry.expected(s.params.max_tokens, len(s.completion_ids), share), seq_tokens(s),
                        len(s.block_table)) for s in tuple(self._running)]
        waiting = [Work(self.retry.expected(s.params.max_tokens, len(s.completion_ids), share), seq_tokens(s),
                        kv.pages_for(s)) for s in tuple(self._waiting)]
        return self.retry.forecast(running, waiting, self.num_free_slots, self.free_pages if kv.num_pages else None,
                                   kv.num_slots, now)

    def schedule(self, *, version: int, paused: bool = False, now: float = 0.0) -> ScheduledBatch[ServerSequence]:
        """One step's batch: abort expired requests, take the released sequences out of the batch (their
        slots and pages come back), then dllm's schedule (growth, preemption, admission; while paused,
        only preempted sequences go on), admitted ones stamped with `now` the first time."""
        dropped = self._expire(now)
        released = self.take_releases()
        batch = super().schedule(version=version, paused=paused)
        for seq in batch.admitted:
            if seq.admitted_at is None:
                seq.admitted_at = now
        self.waiting_tokens += sum(seq_tokens(s) for s in batch.preempted)
        self.waiting_tokens -= sum(seq_tokens(s) for s in batch.admitted)
        batch.released, batch.dropped = released, dropped
        return batch

    def postprocess(self, batch: ScheduledBatch[ServerSequence], out: StepOutput,
                    now: float = 0.0) -> list[ServerSequence]:
        """The runner's outputs -> the sequences that ended (stop ids, stop strings, max_tokens, a failed
        row; finish reason set once); they give back their slot and pages (then the engine finishes them)."""
        ended = super().postprocess(batch, out)
        self.retry.stepped(len(batch.running), out.num_committed, now)  # the decode rate (retry_after)
        for seq in batch.running:
            if seq.first_token_at is None and seq.completion_ids:
                seq.first_token_at = now
        for seq in ended:
            seq.finished_at = now
            if seq.finish_reason != FinishReason.ERROR:
                self._count_finished(seq)
        return ended

    def _expire(self, now: float) -> list[ServerSequence]:
        """Abort the requests past their deadline: each unfinished sequence gets the reason as its error;
        waiting ones are dropped (returned), running ones released by this same schedule."""
        dropped = []
        for req in self.expired(now):
            waited = any(s.status is SeqStatus.WAITING for s in req.seqs)
            req.expired = (f"request deadline exceeded after {now - req.arrival:.1f}s (the request's "
                           f"`timeout`, capped by server.max_request_s) "
                           + ("waiting for KV cache pages (prompt + max_tokens = "
                              f"{req.num_tokens} tokens)" if waited else "during generation")
                           + "; aborted, its cache freed")
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.error = req.expired
            dropped += self.abort(req)
        return dropped

    def expired(self, now: float) -> list[Request]:
        """Unfinished requests past their deadline (each returned once; the caller aborts them)."""
        out = [r for d, r in self._with_deadline if d <= now and not r.is_finished]
        self._with_deadline = [(d, r) for d, r in self._with_deadline if d > now and not r.is_finished]
        return out

    def abort(self, req: Request) -> list[ServerSequence]:
        """Abort every unfinished sequence of `req`: the waiting ones are dropped (returned, to be
        finished by the caller: waiting -> done), the running ones released by the next step."""
        req.is_aborted = True
        ids = {s.seq_id for s in req.seqs if not s.is_finished}
        dropped = [s for s in self._waiting if s.seq_id in ids]
        self._waiting = deque(s for s in self._waiting if s.seq_id not in ids)
        self.waiting_tokens -= sum(seq_tokens(s) for s in dropped)
        for s in self._running:
            if s.seq_id in ids and s.status is SeqStatus.RUNNING:
                s.status = SeqStatus.RELEASING
                self._releasing.append(s)
        for s in dropped:
            self._end(s, FinishReason.ABORT)
        return dropped

    def abort_running(self) -> None:
        """running -> releasing, every running sequence (pause with abort_inflight); preempted ones too."""
        for s in self._running:
            if s.status is SeqStatus.RUNNING:
                s.status = SeqStatus.RELEASING
                self._releasing.append(s)
        while self._has_preempted():
            s = self._waiting.popleft()
            self.waiting_tokens -= seq_tokens(s)
            s.status = SeqStatus.RELEASING
            self._running.append(s)  # taken out with the others by take_releases (it holds nothing)
            self._releasing.append(s)

    def take_releases(self) -> list[ServerSequence]:
        """releasing -> out of the batch, slots and pages given back: the caller finishes them (their
        finish reason: abort)."""
        out, self._releasing = self._releasing, []
        self._running = [s for s in self._running if s.status is not SeqStatus.RELEASING]
        for s in out:
            self._release(s)
            self._end(s, FinishReason.ABORT)
        return out

    def finish(self, seq: ServerSequence) -> Request | None:
        """-> FINISHED: a sequence finished, aborted or failed; returns its request (None when it was
        done already). A sequence still waiting must be aborted or taken first."""
        if seq.status is SeqStatus.WAITING and seq.finish_reason is None:
            raise InvalidTransition(f"finish: sequence {seq.seq_id} is still waiting (abort its request first)")
        if seq in self._releasing:
            self._releasing.remove(seq)
        if seq in self._running:
            self._running.remove(seq)
        self._release(seq)
        if seq.status is not SeqStatus.FINISHED and seq.finished_at is None:
            seq.finished_at = time.monotonic()
        seq.status = SeqStatus.FINISHED
        req = self._owner.pop(seq.seq_id, None)
        if req is not None:
            req.num_done += 1
        return req

    def _count_finished(self, seq: ServerSequence) -> None:
        """The recent throughput (retry_after): this sequence's tokens finished now."""
        now = time.monotonic()
        self._finished.append((now, seq_tokens(seq)))
        self.retry.finished(len(seq.completion_ids), int(seq.params.max_tokens))
        while self._finished[0][0] < now - THROUGHPUT_WINDOW_S:
            self._finished.popleft()

    def fail(self, batch: list[ServerSequence]) -> list[tuple[ServerSequence, Request]]:
        """-> done: the sequences of a failed forward (nothing it was to compute is cached); returns
        (sequence, request) for those whose request still waits for them."""
        self.blocks.forget_owed()
        out = []
        for seq in batch:
            self._end(seq, FinishReason.ABORT)
            req = self.finish(seq)
            if req is not None:
                out.append((seq, req))
        return out

    def take_all(self) -> list[ServerSequence]:
        """Every waiting and running sequence (shutdown, a crashed engine): the queue is emptied,
        the caller finishes them."""
        out = list(self._waiting) + self._running
        for s in out:
            self._end(s, FinishReason.ABORT)
        self._waiting.clear()
        self.waiting_tokens = 0
        return out
