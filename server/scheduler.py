"""Scheduler: which sequences wait, which run, which must be aborted (pure bookkeeping).

Not thread-safe by itself: the engine calls it only while holding its lock. The scheduler
owns its state: a sequence moves waiting -> running -> (releasing ->) done only through
these transitions (the engine reads `waiting`, `running`, `is_idle`, never edits them):

    sched = Scheduler(max_queue=256, max_queue_tokens=0)
    sched.enqueue(request)                    # -> waiting; QueueFull (with retry_after) when the queue is full
    admitted = sched.admit(num_free_slots)    # waiting -> running, FIFO: oldest waiting sequences first
    dropped = sched.abort(request)            # waiting -> done (returned); running -> releasing
    sched.abort_running()                     # every running sequence -> releasing (pause with abort)
    reqs = sched.expired(now)                 # requests past their deadline (the engine aborts them)
    released = sched.take_releases()          # releasing -> out of the batch (the backend frees them)
    req = sched.finish(seq)                   # running / releasing / dropped -> done; returns its request
    pairs = sched.fail(batch)                 # a failed forward: its sequences -> done, with their requests
    left = sched.take_all()                   # shutdown: every waiting and running sequence, queue emptied

An invalid transition (enqueueing a sequence twice, finishing one that still waits) raises
`InvalidTransition`: a bug in the caller, never a client's doing.

A `Request` groups the sequences of one HTTP request (prompts x n) and carries the
asyncio queue its handler reads events from (filled from the engine thread).

Back-pressure: the queue is bounded in sequences (`max_queue`) and in tokens
(`max_queue_tokens`: prompt + max_tokens of every waiting sequence, what they will need in
KV pages; 0 = unbounded); a request over either bound is refused (429) with a `retry_after`
from its place in the queue and the measured service rate (server.retry_after.RetryAfter). A sequence is
given its KV pages for prompt + max_tokens when it is admitted (dllm.decoding.Decoder.add),
so a running sequence never runs out of cache mid-generation and nothing is preempted: a
request waits in the queue until its pages are free, at most until its deadline
(`seq.deadline`, server.generation.request_deadline), when `expired()` hands it to the
engine to abort (503 naming the reason, its slots and pages freed).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dllm.trace import FinishReason
from server.retry_after import RetryAfter

THROUGHPUT_WINDOW_S = 60.0


class InvalidTransition(RuntimeError):
    """A scheduler transition that the sequence's state does not allow (a bug in the caller)."""


class QueueFull(RuntimeError):
    """The waiting queue cannot take the request's sequences (-> HTTP 429, Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


def seq_tokens(seq: Any) -> int:
    """What a sequence will hold in the KV cache: prompt + max_tokens."""
    return len(seq.prompt_ids) + int(seq.params.max_tokens)


@dataclass
class Request:
    request_id: str
    seqs: list[Any]                      # dllm.decoding.Sequence, prompt-major order (p * n + i)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stream: bool = False
    arrival: float = field(default_factory=time.monotonic)
    num_done: int = 0
    is_aborted: bool = False
    expired: str = ""                    # why the request was aborted at its deadline ("" = it was not)

    def __post_init__(self) -> None:
        self.index_of = {s.seq_id: i for i, s in enumerate(self.seqs)}
        deadlines = [d for s in self.seqs if (d := getattr(s, "deadline", None)) is not None]
        self.deadline: float | None = min(deadlines) if deadlines else None
        self.deadline_status = max((getattr(s, "deadline_status", 0) for s in self.seqs), default=0) or 503
        self.num_tokens = sum(seq_tokens(s) for s in self.seqs)

    @property
    def is_finished(self) -> bool:
        return self.num_done == len(self.seqs)

    def emit(self, event: tuple) -> None:
        """Thread-safe: hand an event to the request's handler on its event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # loop closed: the client is gone
            pass


class Scheduler:
    def __init__(self, max_queue: int, max_queue_tokens: int = 0):
        self.max_queue, self.max_queue_tokens = max_queue, max_queue_tokens
        self.waiting_tokens = 0
        self.retry = RetryAfter()  # server.retry_after: Retry-After from the queue and the admission rate
        self._finished: deque[tuple[float, int]] = deque()  # (time, tokens) of recently finished sequences
        self._with_deadline: list[tuple[float, Request]] = []  # (its deadline, a request that has one)
        self._waiting: deque[Any] = deque()
        self._waiting_ids: set[int] = set()
        self._running: list[Any] = []
        self._releasing: list[Any] = []     # running sequences aborted by a client, a deadline or pause
        self._owner: dict[int, Request] = {}  # seq_id -> request, until the sequence is done

    # ------------------------------------------------------------------ reading
    @property
    def waiting(self) -> tuple[Any, ...]:
        """The waiting sequences, oldest first (a snapshot)."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Any, ...]:
        """The running sequences: the next forward's batch (a snapshot)."""
        return tuple(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def is_idle(self) -> bool:
        """Nothing runs and nothing waits to be released (a paused engine is then drained)."""
        return not (self._running or self._releasing)

    def has_work(self, is_paused: bool) -> bool:
        return bool(self._running or self._releasing or (self._waiting and not is_paused))

    def request_of(self, seq: Any) -> Request | None:
        """The request of a sequence not done yet (None once it is)."""
        return self._owner.get(seq.seq_id)

    def requests(self) -> list[Request]:
        """Every request with a sequence not done yet, in arrival order."""
        return list({id(r): r for r in self._owner.values()}.values())

    # ------------------------------------------------------------------ transitions
    def enqueue(self, req: Request) -> None:
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
        again = [s.seq_id for s in req.seqs if s.seq_id in self._owner]
        if again:
            raise InvalidTransition(f"enqueue: sequences {again} are already scheduled")
        for seq in req.seqs:
            self._owner[seq.seq_id] = req
            self._waiting.append(seq)
            self._waiting_ids.add(seq.seq_id)
        self.waiting_tokens += req.num_tokens
        if req.deadline is not None:
            self._with_deadline.append((req.deadline, req))

    def retry_after(self, excess_seqs: int, excess_tokens: int) -> int:
        """Seconds until a refused request fits, `excess` waiting sequences / tokens ahead (server.retry_after)."""
        return self.retry.estimate(excess_seqs, excess_tokens, len(self._running))

    def admit(self, num_admissible: int) -> list[Any]:
        """waiting -> running: the `num_admissible` oldest waiting sequences (returned)."""
        admitted: list[Any] = []
        while self._waiting and len(admitted) < num_admissible:
            admitted.append(self._waiting.popleft())
        self._waiting_ids.difference_update(s.seq_id for s in admitted)
        self.waiting_tokens -= sum(seq_tokens(s) for s in admitted)
        self._running.extend(admitted)
        return admitted

    def expired(self, now: float) -> list[Request]:
        """Unfinished requests past their deadline (each returned once; the caller aborts them)."""
        out = [r for d, r in self._with_deadline if d <= now and not r.is_finished]
        self._with_deadline = [(d, r) for d, r in self._with_deadline if d > now and not r.is_finished]
        return out

    def abort(self, req: Request) -> list[Any]:
        """Abort every unfinished sequence of `req`: the waiting ones are dropped (returned, to be
        finished by the caller: waiting -> done), the running ones released by the next iteration."""
        req.is_aborted = True
        ids = {s.seq_id for s in req.seqs if not s.is_finished}
        dropped = [s for s in self._waiting if s.seq_id in ids]
        self._waiting = deque(s for s in self._waiting if s.seq_id not in ids)
        self._waiting_ids.difference_update(s.seq_id for s in dropped)
        self.waiting_tokens -= sum(seq_tokens(s) for s in dropped)
        self._releasing += [s for s in self._running if s.seq_id in ids and s not in self._releasing]
        for s in dropped:
            s.finish_reason = s.trace.finish_reason = FinishReason.ABORT
        return dropped

    def abort_running(self) -> None:
        """running -> releasing, every running sequence (pause with abort_inflight)."""
        self._releasing += [s for s in self._running if s not in self._releasing]

    def take_releases(self) -> list[Any]:
        """releasing -> out of the batch: the caller frees their slots, then finishes them."""
        out, self._releasing = self._releasing, []
        self._running = [s for s in self._running if s not in out]
        return out

    def finish(self, seq: Any) -> Request | None:
        """-> done: a sequence finished, aborted or failed; returns its request (None when it was
        done already). A sequence still waiting must be aborted or taken first."""
        if seq.seq_id in self._waiting_ids:
            raise InvalidTransition(f"finish: sequence {seq.seq_id} is still waiting (abort its request first)")
        if seq in self._releasing:
            self._releasing.remove(seq)
        if seq in self._running:
            self._running.remove(seq)
            if seq.finish_reason != FinishReason.ABORT and not getattr(seq, "error", None):
                now = time.monotonic()
                self._finished.append((now, seq_tokens(seq)))
                self.retry.finished(now - getattr(seq, "admitted_at", now), seq_tokens(seq), now)
                while self._finished[0][0] < now - THROUGHPUT_WINDOW_S:
                    self._finished.popleft()
        req = self._owner.pop(seq.seq_id, None)
        if req is not None:
            req.num_done += 1
        return req

    def fail(self, batch: list[Any]) -> list[tuple[Any, Request]]:
        """-> done: the sequences of a failed forward; returns (sequence, request) for those whose
        request still waits for them."""
        out = []
        for seq in batch:
            req = self.finish(seq)
            if req is not None:
                out.append((seq, req))
        return out

    def take_all(self) -> list[Any]:
        """Every waiting and running sequence (shutdown, a crashed engine): the queue is emptied,
        the caller releases and finishes them."""
        out = list(self._waiting) + self._running
        self._waiting.clear()
        self._waiting_ids.clear()
        self.waiting_tokens = 0
        return out
