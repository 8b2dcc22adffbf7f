"""RetryAfter: how long a request refused for a full queue should wait, from the queue itself.

    est = RetryAfter()                              # one per Scheduler (server.engine.scheduler)
    est.finished(run_s, num_tokens)                 # each sequence that ran to its end
    seconds = est.estimate(3, 0, num_running=16)    # a refusal: 3 waiting sequences must leave first

The wait is the refused request's position divided by the rate at which the queue drains.
Its position: the waiting sequences (or tokens) that must be admitted before it fits, plus the
places booked by the requests refused before it that have not come back yet (each refusal
books its shortfall until its retry time, so a burst of refused clients is told to come back
one after the other, not all in the same second). The rate: waiting sequences are admitted as
fast as running ones finish, `num_running` / the mean run time (admission to end) of the
sequences that finished over the last `window_s` (Little's law: it holds however the finishes
cluster in steps, and idle time does not dilute it); tokens per second is that times their
mean prompt + max_tokens. Before any sequence finished, one second per place. Rounded up to
whole seconds (Retry-After's unit), 1..`max_s`. A client that waits exactly that long finds
its place free most of the time, and the value grows with the queue. A client that ignores
Retry-After and comes back sooner is refused again (and books again); one refused by its
key's quota books nothing (server.api.gate).
Thread-safe: the engine thread records finishes, the event loop asks for estimates.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque

WINDOW_S = 60.0  # run times of the sequences that finished in the last minute
MAX_S = 120


class RetryAfter:
    def __init__(self, window_s: float = WINDOW_S, max_s: int = MAX_S):
        self.window_s, self.max_s = window_s, max_s
        self._finished: deque[tuple[float, float, int]] = deque()  # (time, run seconds, tokens)
        self._run_s = 0.0
        self._tokens = 0
        self._booked: list[tuple[float, int, int]] = []  # heap of (retry time, sequences, tokens) of refusals
        self._booked_seqs = self._booked_tokens = 0
        self._lock = threading.Lock()

    def finished(self, run_s: float, num_tokens: int = 0, now: float | None = None) -> None:
        """Record a sequence that ran `run_s` seconds from admission to its end (engine thread)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._finished.append((now, max(run_s, 0.0), num_tokens))
            self._run_s += max(run_s, 0.0)
            self._tokens += num_tokens
            self._forget(now)

    def rate(self, num_running: int, now: float | None = None) -> tuple[float, float]:
        """(sequences, tokens) per second leaving the queue with `num_running` running; (0, 0) unmeasured."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget(now)
            return self._rate(num_running)

    def estimate(self, excess_seqs: int = 0, excess_tokens: int = 0, num_running: int = 1,
                 now: float | None = None) -> int:
        """Seconds until a refused request fits: `excess_*` must leave the queue first, behind the
        refusals booked before it. Books this one's place until its retry time."""
        now = time.monotonic() if now is None else now
        excess_seqs, excess_tokens = max(excess_seqs, 0), max(excess_tokens, 0)
        with self._lock:
            self._forget(now)
            seqs_per_s, tokens_per_s = self._rate(num_running)
            ahead_seqs, ahead_tokens = excess_seqs + self._booked_seqs, excess_tokens + self._booked_tokens
            if seqs_per_s <= 0:  # nothing measured yet: a second per place
                wait = float(max(1, ahead_seqs))
            else:
                wait = max(ahead_seqs / seqs_per_s, ahead_tokens / tokens_per_s if tokens_per_s else 0.0)
            seconds = int(min(self.max_s, max(1, math.ceil(wait))))
            heapq.heappush(self._booked, (now + seconds, excess_seqs, excess_tokens))
            self._booked_seqs += excess_seqs
            self._booked_tokens += excess_tokens
            return seconds

    def _rate(self, num_running: int) -> tuple[float, float]:
        if not self._finished or self._run_s <= 0:
            return 0.0, 0.0
        n = len(self._finished)
        seqs_per_s = max(num_running, 1) / (self._run_s / n)
        return seqs_per_s, seqs_per_s * self._tokens / n

    def _forget(self, now: float) -> None:
        while self._finished and self._finished[0][0] < now - self.window_s:
            _, run_s, tokens = self._finished.popleft()
            self._run_s -= run_s
            self._tokens -= tokens
        while self._booked and self._booked[0][0] <= now:  # a place is kept until its retry time
            _, seqs, tokens = heapq.heappop(self._booked)
            self._booked_seqs -= seqs
            self._booked_tokens -= tokens


__all__ = ["RetryAfter"]
