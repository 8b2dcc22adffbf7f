"""Scheduler: which sequences wait, which run, which must be aborted (pure bookkeeping).

Not thread-safe by itself: the engine calls it only while holding its lock.

    sched = Scheduler(max_queue=256, max_queue_tokens=0)
    sched.enqueue(request)                    # QueueFull (with retry_after) when the queue is full
    admitted = sched.admit(num_free_slots)    # FIFO: oldest waiting sequences first
    sched.abort(request)                      # drop waiting sequences; running ones -> to_release
    sched.finish(seq)                         # a running sequence is done

A `Request` groups the sequences of one HTTP request (prompts x n) and carries the
asyncio queue its handler reads events from (filled from the engine thread).

Back-pressure: the queue is bounded in sequences (`max_queue`) and in tokens
(`max_queue_tokens`: prompt + max_tokens of every waiting sequence, what they will need in
KV pages; 0 = unbounded); a request over either bound is refused (429) with a `retry_after`
estimated from the recent throughput (sequences or tokens finished per second over the last
`THROUGHPUT_WINDOW_S`): the time the queue needs to drain enough to take it. A sequence is
given its KV pages for prompt + max_tokens when it is admitted (dllm.decoding.Decoder.add),
so a running sequence never runs out of cache mid-generation and nothing is preempted: a
request waits in the queue until its pages are free, at most until its deadline
(`seq.deadline`, server.generation.request_deadline), when `expired()` hands it to the
engine to abort (503 naming the reason, its slots and pages freed).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

THROUGHPUT_WINDOW_S = 60.0


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
        self.deadline = min(deadlines) if deadlines else None
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
        self._finished: deque[tuple[float, int]] = deque()  # (time, tokens) of recently finished sequences
        self._with_deadline: list[Request] = []
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self.to_release: list[Any] = []    # running sequences aborted by a client or pause
        self.owner: dict[int, Request] = {}  # seq_id -> request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self, is_paused: bool) -> bool:
        return bool(self.running or self.to_release or (self.waiting and not is_paused))

    def enqueue(self, req: Request) -> None:
        excess = len(self.waiting) + len(req.seqs) - self.max_queue
        if excess > 0:
            raise QueueFull(f"queue full: {len(self.waiting)} sequences waiting, request adds {len(req.seqs)} "
                            f"(max_queue={self.max_queue}); retry later", self.retry_after(excess, 0))
        excess_tokens = self.waiting_tokens + req.num_tokens - self.max_queue_tokens
        if self.max_queue_tokens and self.waiting and excess_tokens > 0:
            raise QueueFull(f"queue full: the waiting sequences need {self.waiting_tokens} tokens of KV cache, the "
                            f"request adds {req.num_tokens} (prompt + max_tokens; max_queue_tokens="
                            f"{self.max_queue_tokens}); retry later or lower max_tokens",
                            self.retry_after(0, excess_tokens))
        for seq in req.seqs:
            self.owner[seq.seq_id] = req
            self.waiting.append(seq)
        self.waiting_tokens += req.num_tokens
        if req.deadline is not None:
            self._with_deadline.append(req)

    def retry_after(self, excess_seqs: int, excess_tokens: int) -> int:
        """Seconds until the queue has drained by `excess` at the recent throughput (1..120)."""
        now = time.monotonic()
        while self._finished and self._finished[0][0] < now - THROUGHPUT_WINDOW_S:
            self._finished.popleft()
        if not self._finished:
            return 1 if not self.running else 10  # nothing finished lately: long sequences are running
        span = max(now - self._finished[0][0], 1.0)
        seqs_per_s = len(self._finished) / span
        tokens_per_s = sum(t for _, t in self._finished) / span
        wait = max(excess_seqs / seqs_per_s, excess_tokens / tokens_per_s)
        return int(min(120, max(1, math.ceil(wait))))

    def admit(self, num_admissible: int) -> list[Any]:
        admitted = []
        while self.waiting and len(admitted) < num_admissible:
            admitted.append(self.waiting.popleft())
        self.waiting_tokens -= sum(seq_tokens(s) for s in admitted)
        self.running.extend(admitted)
        return admitted

    def expired(self, now: float) -> list[Request]:
        """Unfinished requests past their deadline (each returned once; the caller aborts them)."""
        out = [r for r in self._with_deadline if r.deadline <= now and not r.is_finished]
        self._with_deadline = [r for r in self._with_deadline if r.deadline > now and not r.is_finished]
        return out

    def abort(self, req: Request) -> list[Any]:
        """Abort every unfinished sequence of `req`; returns the waiting ones dropped (finished now)."""
        req.is_aborted = True
        ids = {s.seq_id for s in req.seqs if not s.is_finished}
        dropped = [s for s in self.waiting if s.seq_id in ids]
        self.waiting = deque(s for s in self.waiting if s.seq_id not in ids)
        self.waiting_tokens -= sum(seq_tokens(s) for s in dropped)
        self.to_release += [s for s in self.running if s.seq_id in ids and s not in self.to_release]
        for s in dropped:
            s.finish_reason = s.trace.finish_reason = "abort"
        return dropped

    def abort_running(self) -> None:
        self.to_release += [s for s in self.running if s not in self.to_release]

    def take_releases(self) -> list[Any]:
        out, self.to_release = self.to_release, []
        self.running = [s for s in self.running if s not in out]
        return out

    def finish(self, seq: Any) -> Request | None:
        """Mark a sequence done (finished, aborted or failed); returns its request."""
        if seq in self.running:
            self.running.remove(seq)
            if seq.finish_reason != "abort" and not getattr(seq, "error", None):
                now = time.monotonic()
                self._finished.append((now, seq_tokens(seq)))
                while self._finished[0][0] < now - THROUGHPUT_WINDOW_S:
                    self._finished.popleft()
        req = self.owner.pop(seq.seq_id, None)
        if req is not None:
            req.num_done += 1
        return req
