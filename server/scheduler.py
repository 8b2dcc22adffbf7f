"""Scheduler: which sequences wait, which run, which must be aborted (pure bookkeeping).

Not thread-safe by itself: the engine calls it only while holding its lock.

    sched = Scheduler(max_queue=256)
    sched.enqueue(request)                    # QueueFull when the waiting queue is full
    admitted = sched.admit(num_free_slots)    # FIFO: oldest waiting sequences first
    sched.abort(request)                      # drop waiting sequences; running ones -> to_release
    sched.finish(seq)                         # a running sequence is done

A `Request` groups the sequences of one HTTP request (prompts x n) and carries the
asyncio queue its handler reads events from (filled from the engine thread).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class QueueFull(RuntimeError):
    """The waiting queue cannot take the request's sequences (-> HTTP 429)."""


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

    def __post_init__(self) -> None:
        self.index_of = {s.seq_id: i for i, s in enumerate(self.seqs)}

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
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
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
        if len(self.waiting) + len(req.seqs) > self.max_queue:
            raise QueueFull(f"queue full: {len(self.waiting)} sequences waiting, request adds {len(req.seqs)} "
                            f"(max_queue={self.max_queue}); retry later")
        for seq in req.seqs:
            self.owner[seq.seq_id] = req
            self.waiting.append(seq)

    def admit(self, num_free_slots: int) -> list[Any]:
        admitted = []
        while self.waiting and len(admitted) < num_free_slots:
            admitted.append(self.waiting.popleft())
        self.running.extend(admitted)
        return admitted

    def abort(self, req: Request) -> list[Any]:
        """Abort every unfinished sequence of `req`; returns the waiting ones dropped (finished now)."""
        req.is_aborted = True
        ids = {s.seq_id for s in req.seqs if not s.is_finished}
        dropped = [s for s in self.waiting if s.seq_id in ids]
        self.waiting = deque(s for s in self.waiting if s.seq_id not in ids)
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
        req = self.owner.pop(seq.seq_id, None)
        if req is not None:
            req.num_done += 1
        return req
