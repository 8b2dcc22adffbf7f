"""RetryAfter: how long a request refused for a full queue should wait, from the queue itself.

    est = RetryAfter()                         # one per Scheduler (server.scheduler)
    est.admitted(num_seqs, num_tokens)         # each time waiting sequences are admitted to run
    seconds = est.estimate(excess_seqs=3)      # a refusal: 3 waiting sequences must leave first

The wait is the refused request's position divided by the measured admission rate. Its
position: the waiting sequences (or tokens) that must be admitted before it fits, plus the
places booked by the requests refused before it that have not come back yet (each refusal
books its shortfall until its retry time, so a burst of refused clients is told to come back
one after the other, not all in the same second). The rate: sequences (tokens) admitted per
second while others waited, over the admissions of the last `window_s`: the gap between two
admissions counts only when the first left sequences waiting (then the gap is the time a
place took to free), so idle time and admissions into an idle engine (free slots filled at
once) say nothing about it. Before any such gap, one second per place. Rounded up to whole
seconds (Retry-After's unit), 1..`max_s`. A client that waits exactly that long finds its
place free most of the time, and the value grows with the queue. A client that ignores
Retry-After and comes back sooner is refused again (and books again); one refused by its
key's quota books nothing (server.gate).
Thread-safe: the engine thread records admissions, the event loop asks for estimates.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque

WINDOW_S = 120.0  # admissions measured over the last 2 minutes (of backlog: idle time does not count)
MAX_S = 120


class RetryAfter:
    def __init__(self, window_s: float = WINDOW_S, max_s: int = MAX_S):
        self.window_s, self.max_s = window_s, max_s
        self._served: deque[tuple[float, float, int, int]] = deque()  # (time, gap s, sequences, tokens)
        self._last: float | None = None   # time of the last admission ...
        self._backlog = 0                 # ... and the sequences it left waiting
        self._booked: list[tuple[float, int, int]] = []  # heap of (retry time, sequences, tokens) of refusals
        self._booked_seqs = self._booked_tokens = 0
        self._lock = threading.Lock()

    def admitted(self, num_seqs: int, num_tokens: int = 0, num_left: int = 0, now: float | None = None) -> None:
        """Record waiting sequences admitted to run, `num_left` still waiting after them (engine thread)."""
        if num_seqs <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._last is not None and self._backlog > 0:  # they waited since the last admission: a service gap
                self._served.append((now, now - self._last, num_seqs, num_tokens))
            self._last, self._backlog = now, num_left
            self._forget(now)

    def rate(self, now: float | None = None) -> tuple[float, float]:
        """(sequences, tokens) admitted per second of backlog over the window; (0, 0) before any."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget(now)
            return self._rate()

    def estimate(self, excess_seqs: int = 0, excess_tokens: int = 0, now: float | None = None) -> int:
        """Seconds until a refused request fits: `excess_*` must leave the queue first, behind the
        refusals booked before it. Books this one's place until its retry time."""
        now = time.monotonic() if now is None else now
        excess_seqs, excess_tokens = max(excess_seqs, 0), max(excess_tokens, 0)
        with self._lock:
            self._forget(now)
            seqs_per_s, tokens_per_s = self._rate()
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

    def _rate(self) -> tuple[float, float]:
        busy = sum(g for _, g, _, _ in self._served)
        if busy <= 0:
            return 0.0, 0.0
        return sum(s for _, _, s, _ in self._served) / busy, sum(t for _, _, _, t in self._served) / busy

    def _forget(self, now: float) -> None:
        while self._served and self._served[0][0] < now - self.window_s:
            self._served.popleft()
        while self._booked and self._booked[0][0] <= now:  # a place is kept until its retry time
            _, seqs, tokens = heapq.heappop(self._booked)
            self._booked_seqs -= seqs
            self._booked_tokens -= tokens


__all__ = ["RetryAfter"]
