"""Scheduler: owns every sequence of the engine -- its status, its KV slot and pages, its post-processing.

Not thread-safe by itself: the engine calls it while holding its lock (but `postprocess`, which
touches only the batch's sequences and the KV accounting, both the engine thread's alone). A
`ServerSequence` (server/engine/sequence.py) moves NEW -> WAITING -> RUNNING -> (RELEASING ->) FINISHED
only through these methods (the engine reads `waiting`, `running`, `is_idle`, never edits them):

    sched = Scheduler(max_queue=256, kv=KVBudget(num_slots=16, num_pages=2048, page_tokens=4),
                      post=runner.postprocessor())
    sched.enqueue(request)                    # -> waiting; QueueFull (with retry_after) when the queue is full
    batch = sched.schedule(paused=False, version=3, now=t)   # one engine step's ScheduledBatch:
        # expired requests aborted (batch.dropped: waiting ones, done), releasing -> out (batch.released:
        # the runner frees their cache), waiting -> running FIFO while a slot and the KV pages are free
        # (batch.admitted), batch.running: the forward's batch
    finished = sched.postprocess(batch, out, now=t)   # the runner's StepOutput: stop ids, stop strings,
        # max_tokens, finish reason (dllm.postprocess.Postprocessor); ended ones give back slot + pages
    dropped = sched.abort(request)            # waiting -> done (returned); running -> releasing
    sched.abort_running()                     # every running sequence -> releasing (pause with abort)
    req = sched.finish(seq)                   # running / releasing / dropped -> finished; returns its request
    pairs = sched.fail(batch)                 # a failed forward: its sequences -> finished, with their requests
    left = sched.take_all()                   # shutdown: every waiting and running sequence, queue emptied

An invalid transition (enqueueing a sequence twice, finishing one that still waits) raises
`InvalidTransition`: a bug in the caller, never a client's doing.

KV accounting: `KVBudget` is the runner's cache (slots = rows of its page table, pages of
`page_tokens` tokens; `num_pages` 0 = unpaged, slots only). A sequence is admitted only when a
slot and the pages of its prompt + max_tokens are free; it holds them until it ends, so a
running sequence never runs out of cache mid-generation and nothing is preempted. With
`KVBudget(optimistic=True)` (server.kv_admission=optimistic) a sequence is admitted on the pages
its next forward touches and its account grows block by block; when the running sequences' next
blocks do not fit, the newest ones are preempted (`batch.preempted`: back to the queue's front,
slot and pages given back; the runner drops their cache but they keep their tokens and trace)
and re-admitted first, their cache recomputed (vLLM's preemption by recompute). A preempted
sequence keeps its version: while paused, preempted ones are still re-admitted and the engine is
drained only once they finish too. The runner
allocates the physical pages at the slot the scheduler chose (`batch.admitted`) and frees them
when told (`batch.released`, the finished ones): its pool mirrors this account.

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
from typing import cast

from dllm.decoding import StepOutput
from dllm.postprocess import Postprocessor
from dllm.trace import FinishReason
from server.engine.retry_after import Forecast, RetryAfter, Work
from server.engine.sequence import SeqStatus, ServerSequence

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


@dataclass(frozen=True)
class KVBudget:
    """The runner's KV cache as the scheduler accounts for it."""

    num_slots: int        # sequences at once (rows of the page table)
    num_pages: int = 0    # pages in the pool; 0 = unpaged (only slots count)
    page_tokens: int = 1  # tokens per page (the block size)
    optimistic: bool = False  # admit on the next forward's pages, grow per block, preempt (see above)

    def pages_for(self, seq: ServerSequence) -> int:
        """Pages a sequence is given: prompt + max_tokens (optimistic: those its next forward touches)."""
        if not self.num_pages:
            return 0
        if not self.optimistic:
            return -(-seq_tokens(seq) // self.page_tokens)
        return -(-(seq.end_pos + (seq.block_size if seq.block_done else 0)) // self.page_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds at once."""
        return self.num_pages * self.page_tokens


@dataclass
class ScheduledBatch:
    """One engine step, as the scheduler planned it."""

    running: list[ServerSequence]   # the forward's batch, oldest first (admitted ones included)
    admitted: list[ServerSequence]  # new in this step: the runner allocates their pages at seq.slot
    released: list[ServerSequence]  # aborted while running: out of the batch, the runner frees their cache
    dropped: list[ServerSequence]   # aborted while waiting (deadline): done, never ran
    num_cache_refused: int = 0      # waiting sequences a free slot could take but the KV pages could not
    preempted: list[ServerSequence] = field(default_factory=list)  # out of the batch, back to waiting: the
    # runner drops their cache first (optimistic admission)


@dataclass
class Request:
    request_id: str
    seqs: list[ServerSequence]           # prompt-major order (p * n + i)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stream: bool = False
    arrival: float = field(default_factory=time.monotonic)
    num_done: int = 0
    is_aborted: bool = False
    expired: str = ""                    # why the request was aborted at its deadline ("" = it was not)
    sink: Callable[[Request, tuple], None] | None = None  # events go here (engine thread) instead of `events`

    def __post_init__(self) -> None:
        self.index_of = {s.seq_id: i for i, s in enumerate(self.seqs)}
        deadlines = [s.deadline for s in self.seqs if s.deadline is not None]
        self.deadline: float | None = min(deadlines) if deadlines else None
        self.deadline_status = max((s.deadline_status for s in self.seqs), default=0) or 503
        self.num_tokens = sum(seq_tokens(s) for s in self.seqs)

    @property
    def is_finished(self) -> bool:
        return self.num_done == len(self.seqs)

    def emit(self, event: tuple) -> None:
        """Thread-safe: hand an event to the request's handler on its event loop (or to its `sink`, at once)."""
        if self.sink is not None:
            self.sink(self, event)
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # loop closed: the client is gone
            pass


class Scheduler:
    def __init__(self, max_queue: int, max_queue_tokens: int = 0, *, kv: KVBudget | None = None,
                 post: Postprocessor | None = None):
        """`kv` and `post` come from the runner (Engine); without them (queue bookkeeping alone, tests): as
        many slots as `max_queue`, unpaged, and no stop rules but max_tokens."""
        self.max_queue, self.max_queue_tokens = max_queue, max_queue_tokens
        kv = kv or KVBudget(max_queue)
        self.kv = kv
        self.post = post or Postprocessor(eos_ids=(), tokenizer=None, max_len=sys.maxsize, block_size=1)
        self.waiting_tokens = 0
        self.retry = RetryAfter()  # server.engine.retry_after: Retry-After from the work ahead and the decode rate
        self.free_slots = list(range(kv.num_slots))[::-1]
        self.free_pages = kv.num_pages
        self._finished: deque[tuple[float, int]] = deque()  # (time, tokens) of recently finished sequences
        self._with_deadline: list[tuple[float, Request]] = []  # (its deadline, a request that has one)
        self._waiting: deque[ServerSequence] = deque()
        self._running: list[ServerSequence] = []
        self._releasing: list[ServerSequence] = []  # running sequences aborted by a client, a deadline or pause
        self._owner: dict[int, Request] = {}  # seq_id -> request, until the sequence is done
        self._holding: dict[int, tuple[int, int]] = {}  # seq_id -> (slot, pages) it holds, until given back

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
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def is_idle(self) -> bool:
        """Nothing runs, nothing waits to be released and no preempted sequence waits to go on (a paused
        engine is then drained)."""
        return not (self._running or self._releasing or self._has_preempted())

    def has_work(self, is_paused: bool) -> bool:
        return bool(self._running or self._releasing or (self._waiting and not is_paused) or self._has_preempted())

    def _has_preempted(self) -> bool:
        """A preempted sequence waits (it was admitted once): the front of the queue (they go back there)."""
        return bool(self._waiting) and self._waiting[0].admitted_at is not None

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
            self._waiting.append(seq)
            seq.status, seq.arrived_at = SeqStatus.WAITING, req.arrival
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
        running = [Work(self.retry.expected(s.params.max_tokens, len(s.completion_ids), share), seq_tokens(s),
                        self._holding.get(s.seq_id, (0, 0))[1]) for s in tuple(self._running)]
        waiting = [Work(self.retry.expected(s.params.max_tokens, len(s.completion_ids), share), seq_tokens(s),
                        self.kv.pages_for(s)) for s in tuple(self._waiting)]
        return self.retry.forecast(running, waiting, len(self.free_slots), self.free_pages if self.kv.num_pages else None,
                                   self.kv.num_slots, now)

    def schedule(self, *, paused: bool, version: int, now: float) -> ScheduledBatch:
        """One step's batch: abort expired requests, take the released sequences out of the batch (their
        slots and pages come back), admit waiting ones that fit (none while paused) stamped with `version`."""
        dropped = self._expire(now)
        released = self.take_releases()
        preempted = self._grow() if self.kv.optimistic and self.kv.num_pages else []
        admitted, refused = self._admit(version, now, only_preempted=paused, after=preempted)
        return ScheduledBatch(list(self._running), admitted, released, dropped, refused, preempted)

    def _grow(self) -> list[ServerSequence]:
        """Optimistic admission: give every running sequence the pages of its next forward, preempting the
        newest ones (back to the queue's front) while they do not fit; returns the preempted."""
        def deficit() -> int:
            return sum(max(0, self.kv.pages_for(s) - self._holding[s.seq_id][1]) for s in self._running)

        preempted: list[ServerSequence] = []
        while len(self._running) > 1 and deficit() > self.free_pages:
            seq = self._running.pop()  # the newest admitted
            self._give_back(seq)
            seq.status = SeqStatus.WAITING  # the runner drops its cache (and slot) first: batch.preempted
            self._waiting.appendleft(seq)
            self.waiting_tokens += seq_tokens(seq)
            preempted.append(seq)
        for s in self._running:
            slot, held = self._holding[s.seq_id]
            more = max(0, self.kv.pages_for(s) - held)
            self._holding[s.seq_id], self.free_pages = (slot, held + more), self.free_pages - more
            s.num_pages = held + more
        return preempted

    def _admit(self, version: int, now: float, only_preempted: bool = False,
               after: list[ServerSequence] | None = None) -> tuple[list[ServerSequence], int]:
        """WAITING -> RUNNING, FIFO, while a slot and the sequence's KV pages are free; (admitted, how
        many more waiting ones a free slot could take but the pages could not). `only_preempted` (paused):
        only preempted sequences go on; `after`: those preempted by this very step wait for the next."""
        admitted: list[ServerSequence] = []
        just = {s.seq_id for s in after or ()}
        while self._waiting and self.free_slots and self.kv.pages_for(self._waiting[0]) <= self.free_pages:
            if self._waiting[0].seq_id in just or (only_preempted and self._waiting[0].admitted_at is None):
                break
            seq = self._waiting.popleft()
            seq.num_pages = self.kv.pages_for(seq)
            seq.slot, self.free_pages = self.free_slots.pop(), self.free_pages - seq.num_pages
            self._holding[seq.seq_id] = (seq.slot, seq.num_pages)
            if seq.admitted_at is None:  # a preempted sequence keeps its version (never mixes two)
                seq.admitted_at, seq.trace.version = now, version
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
        self.waiting_tokens -= sum(seq_tokens(s) for s in admitted)
        self._running.extend(admitted)
        return admitted, min(len(self._waiting), len(self.free_slots))

    def _give_back(self, seq: ServerSequence) -> None:
        """Return a running sequence's slot and pages to the account (once)."""
        held = self._holding.pop(seq.seq_id, None)
        if held is not None:
            self.free_slots.append(held[0])
            self.free_pages += held[1]

    def postprocess(self, batch: ScheduledBatch, out: StepOutput, now: float) -> list[ServerSequence]:
        """The runner's outputs -> the sequences that ended (stop ids, stop strings, max_tokens, a failed
        row; finish reason set once); they give back their slot and pages (the runner frees their cache,
        then the engine finishes them)."""
        ended = cast(list[ServerSequence], self.post(out.outputs))  # outputs of batch.running
        self.retry.stepped(len(batch.running), out.num_committed, now)  # the decode rate (retry_after)
        for seq in batch.running:
            if seq.first_token_at is None and seq.completion_ids:
                seq.first_token_at = now
        for seq in ended:
            self._give_back(seq)
            seq.finished_at = now
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
            s.finish_reason = FinishReason.ABORT
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
        """releasing -> out of the batch, slots and pages given back: the caller frees their cache, then
        finishes them (their finish reason: abort)."""
        out, self._releasing = self._releasing, []
        self._running = [s for s in self._running if s.status is not SeqStatus.RELEASING]
        for s in out:
            self._give_back(s)
            if s.finish_reason is None:
                s.finish_reason = FinishReason.ABORT
        return out

    def finish(self, seq: ServerSequence) -> Request | None:
        """-> FINISHED: a sequence finished, aborted or failed; returns its request (None when it was
        done already). A sequence still waiting must be aborted or taken first."""
        if seq.status is SeqStatus.WAITING and seq.finish_reason is None:
            raise InvalidTransition(f"finish: sequence {seq.seq_id} is still waiting (abort its request first)")
        if seq in self._releasing:
            self._releasing.remove(seq)
        if seq in self._running:
            self._give_back(seq)
            self._running.remove(seq)
            if seq.finish_reason != FinishReason.ABORT and not seq.error:
                self._count_finished(seq)
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
        """-> done: the sequences of a failed forward; returns (sequence, request) for those whose
        request still waits for them."""
        out = []
        for seq in batch:
            seq.finish_reason = seq.finish_reason or FinishReason.ABORT
            req = self.finish(seq)
            if req is not None:
                out.append((seq, req))
        return out

    def take_all(self) -> list[ServerSequence]:
        """Every waiting and running sequence (shutdown, a crashed engine): the queue is emptied,
        the caller releases and finishes them."""
        out = list(self._waiting) + self._running
        for s in out:
            s.finish_reason = s.finish_reason or FinishReason.ABORT
        self._waiting.clear()
        self.waiting_tokens = 0
        return out
