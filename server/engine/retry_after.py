"""RetryAfter: how long a request refused for a full queue should wait, from the work ahead of it.

    est = RetryAfter()                                  # one per Scheduler (and one per API process)
    est.stepped(num_seqs=4, num_tokens=9, now=t)        # each engine step: tokens it committed over its batch
    est.finished(num_generated=30, max_tokens=32)       # each sequence that ran to its end
    fc = est.forecast(running, waiting, free_slots=0, free_pages=12, num_slots=4)   # [Work], the scheduler's state
    seconds = est.estimate(3, 0, fc)                    # a refusal: 3 waiting sequences must leave first

A refused request fits once enough waiting sequences have left the queue (been admitted into the
batch), and a waiting sequence leaves when a running one ends and frees its slot and KV pages. How
long that takes depends on the work ahead, not on the number of sequences: 4 sequences with 380
tokens still to decode take ten times longer to end than 4 with 38. So the forecast simulates it:
each running sequence ends after its remaining tokens at the measured per-sequence decode rate,
the waiting ones are admitted in order as slots and pages free up (each then runs for its own
tokens), and past the real queue the same continues with sequences like the last one (the places
booked by earlier refusals, whose requests are not in the queue yet). The k-th departure time is
when the k-th place frees; a refusal's position is its shortfall plus the places booked by the
refusals before it that have not come back yet (each refusal books its shortfall until its retry
time, so a burst is told to come back one after the other, not all in the same second).

The rate: completion tokens per second per running sequence, from the engine's steps (tokens a step
committed over its batch, over the time since the previous step) in the last `window_s`; it is
known after the first steps, before any sequence ended. A sequence is expected to generate the share
of its max_tokens that recent finished sequences did (all of it for ignore_eos work). Before any step
was measured: one second per place. The wait is rounded up to whole seconds (Retry-After's unit)
after a `margin` (10 %), 1..`max_s`. A client that waits exactly that long finds its place free most
of the time at every request length (`benchmarks/flood.py retry`); one that comes back sooner is
refused again (and books again); one refused by its key's quota books nothing (server.api.gate).

A `Forecast` is plain data: the engine core publishes it with its load (server.core), and an API
process answers the refusals it decides itself (server.api.gate) from it with its own bookings.
Thread-safe: the engine thread records steps and finishes, the event loop asks for estimates.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

WINDOW_S = 30.0  # the steps of the last half minute give the decode rate
MAX_S = 120
MARGIN = 0.1  # a forecast's error: waits are stretched by this share before rounding up
HORIZON = 64  # departures simulated past the real queue (booked places); beyond: the steady rate
MAX_GAP_S = 2.0  # a longer time between two steps is not decoding (a pause, an update)


@dataclass(frozen=True)
class Work:
    """A sequence as the forecast sees it."""

    remaining: int  # completion tokens it is expected to decode still
    tokens: int     # prompt + max_tokens: what it counts against the queue's token bound
    pages: int      # KV pages it holds (running) or needs to be admitted (waiting); 0 unpaged


@dataclass(frozen=True)
class Forecast:
    """When the next waiting sequences leave the queue, made at `at` (time.monotonic())."""

    at: float
    times: tuple[float, ...] = ()   # seconds after `at` at which the k-th waiting sequence leaves
    tokens: tuple[int, ...] = ()    # its prompt + max_tokens
    tail_s: float = 1.0             # seconds per departure past the last one (1 s: nothing measured)
    tail_tokens: int = 1            # tokens of a departure past the last one
    measured: bool = False          # from a measured rate (False: the 1 s per place guess, no margin)

    def wait(self, num_seqs: int, num_tokens: int, now: float) -> float:
        """Seconds from `now` until `num_seqs` sequences holding `num_tokens` tokens have left."""
        need, total, k = max(num_seqs, 0), 0, 0
        for k, (t, n) in enumerate(zip(self.times, self.tokens), 1):
            total += n
            if k >= need and total >= num_tokens:
                return max(0.0, t - (now - self.at))
        last = self.times[-1] if self.times else 0.0
        more = max(need - k, math.ceil(max(0, num_tokens - total) / max(self.tail_tokens, 1)), 0)
        return max(0.0, last + more * self.tail_s - (now - self.at))


class RetryAfter:
    def __init__(self, window_s: float = WINDOW_S, max_s: int = MAX_S, margin: float = MARGIN):
        self.window_s, self.max_s, self.margin = window_s, max_s, margin
        self._steps: deque[tuple[float, float, float]] = deque()  # (time, tokens per sequence, seconds)
        self._tokens = self._seconds = 0.0
        self._last_step: float | None = None
        self._done: deque[tuple[int, int]] = deque(maxlen=256)  # (generated, max_tokens) of finished sequences
        self._booked: list[tuple[float, int, int]] = []  # heap of (retry time, sequences, tokens) of refusals
        self._booked_seqs = self._booked_tokens = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ measuring (engine thread)
    def stepped(self, num_seqs: int, num_tokens: int, now: float | None = None) -> None:
        """An engine step committed `num_tokens` tokens over `num_seqs` running sequences."""
        now = time.monotonic() if now is None else now
        with self._lock:
            last, self._last_step = self._last_step, now
            if last is None or num_seqs <= 0 or not 0 < now - last <= MAX_GAP_S:
                return
            self._steps.append((now, num_tokens / num_seqs, now - last))
            self._tokens += num_tokens / num_seqs
            self._seconds += now - last
            self._forget(now)

    def finished(self, num_generated: int, max_tokens: int) -> None:
        """A sequence ended normally after generating `num_generated` of its `max_tokens` tokens."""
        if max_tokens > 0:
            with self._lock:
                self._done.append((min(num_generated, max_tokens), max_tokens))

    def rate(self, now: float | None = None) -> float:
        """Completion tokens per second of one running sequence (0: not measured yet)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget(now)
            return self._tokens / self._seconds if self._seconds > 0 else 0.0

    def share(self) -> float:
        """The share of max_tokens a sequence generates, from the recent finished ones (1 before any)."""
        with self._lock:
            generated, asked = sum(d[0] for d in self._done), sum(d[1] for d in self._done)
        return generated / asked if asked else 1.0

    def expected(self, max_tokens: int, num_done: int = 0, share: float | None = None) -> int:
        """Completion tokens a sequence of `max_tokens` with `num_done` decoded is expected to decode still."""
        left = max_tokens - num_done
        if left <= 0:
            return 0
        share = self.share() if share is None else share
        return max(1, min(left, round(share * max_tokens) - num_done))

    def _forget(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            _, tokens, seconds = self._steps.popleft()
            self._tokens -= tokens
            self._seconds -= seconds
        if not self._steps:
            self._tokens = self._seconds = 0.0

    # ------------------------------------------------------------------ forecasting
    def forecast(self, running: Sequence[Work], waiting: Sequence[Work], free_slots: int, free_pages: int | None,
                 num_slots: int, now: float | None = None, horizon: int = HORIZON) -> Forecast:
        """Simulate the queue draining: running sequences end after their remaining tokens, waiting ones
        are admitted in order into free slots and pages (`free_pages` None: unpaged), then `horizon` more
        like the last waiting one. 1 s per place while no step is measured."""
        now = time.monotonic() if now is None else now
        rate = self.rate(now)
        queue = list(waiting)
        template = queue[-1] if queue else (max(running, key=lambda w: w.tokens) if running else Work(1, 1, 0))
        if rate <= 0:
            return Forecast(now, tail_s=1.0, tail_tokens=max(template.tokens, 1))
        ends = [(w.remaining / rate, w.pages) for w in running]
        heapq.heapify(ends)
        times, tokens = _admissions(_with_more(queue, template, horizon), ends, free_slots,
                                    float("inf") if free_pages is None else float(free_pages), rate)
        tail = template.remaining / rate / max(num_slots, 1)  # a full batch of such: num_slots end per run time
        return Forecast(now, tuple(times), tuple(tokens), max(tail, 1e-3), max(template.tokens, 1), measured=True)

    # ------------------------------------------------------------------ refusals (event loop)
    def estimate(self, excess_seqs: int, excess_tokens: int, forecast: Forecast, now: float | None = None) -> int:
        """Seconds until a refused request fits: `excess_*` must leave the queue first, behind the
        refusals booked before it. Books this one's place until its retry time."""
        now = time.monotonic() if now is None else now
        excess_seqs, excess_tokens = max(excess_seqs, 0), max(excess_tokens, 0)
        with self._lock:
            while self._booked and self._booked[0][0] <= now:  # a place is kept until its retry time
                _, seqs, tokens = heapq.heappop(self._booked)
                self._booked_seqs -= seqs
                self._booked_tokens -= tokens
            wait = forecast.wait(excess_seqs + self._booked_seqs,
                                 excess_tokens + self._booked_tokens if excess_tokens else 0, now)
            wait *= 1 + self.margin if forecast.measured else 1
            seconds = int(min(self.max_s, max(1, math.ceil(wait - 1e-9))))
            heapq.heappush(self._booked, (now + seconds, excess_seqs, excess_tokens))
            self._booked_seqs += excess_seqs
            self._booked_tokens += excess_tokens
            return seconds


def _with_more(queue: list[Work], template: Work, horizon: int) -> Iterator[Work]:
    yield from queue
    for _ in range(horizon):
        yield template


def _admissions(queue: Iterator[Work], ends: list[tuple[float, int]], slots: int, pages: float,
                rate: float) -> tuple[list[float], list[int]]:
    """(admission time, tokens) of each queued sequence in order; `ends` is a heap of (end time, pages)."""
    times: list[float] = []
    tokens: list[int] = []
    t = 0.0
    for w in queue:
        while (slots <= 0 or pages < w.pages) and ends:
            end, freed = heapq.heappop(ends)
            t, slots, pages = max(t, end), slots + 1, pages + freed
        if slots <= 0 or pages < w.pages:  # it never fits (its pages exceed the cache): stop here
            break
        times.append(t)
        tokens.append(w.tokens)
        slots, pages = slots - 1, pages - w.pages
        heapq.heappush(ends, (t + w.remaining / rate, w.pages))
    return times, tokens


__all__ = ["Forecast", "RetryAfter", "Work"]
