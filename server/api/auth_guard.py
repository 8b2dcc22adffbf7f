"""AuthGuard: failed token checks per client address, counted, logged (rate-limited) and throttled.

    guard = AuthGuard(RateLimitedLog(10.0), max_failures=10, window_s=60, throttle_s=60, metrics=metrics)
    guard.check("admin", ip)              # 429 with Retry-After while ip is throttled
    guard.failed("admin", ip, 403)        # after a wrong token; guard.succeeded("admin", ip) after a right one

server.api.auth builds one per app (`ServerState.auth_guard`, from `server.auth_*` config keys) and
runs every bearer-token check through it, logging through a `server.api.connections.RateLimitedLog`.
Imports nothing of the server's state.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Protocol

from fastapi import HTTPException

if TYPE_CHECKING:
    from server.metrics import ServerMetrics

log = logging.getLogger("dlrl.server")


class EventLog(Protocol):
    """What the guard logs failures through (server.api.connections.RateLimitedLog)."""

    def event(self, key: str, msg: str, *args: object) -> None: ...

    def flush(self) -> None: ...  # server.api.lifecycle reports the held-back lines periodically


class AuthGuard:
    """Failed token checks per (token kind, client address): counted, logged (rate-limited), throttled.

    A client with `max_failures` failures within `window_s` gets 429 with Retry-After for
    `throttle_s`, before its token is even compared; a success clears its failures.
    At most `max_clients` addresses are tracked (the least recently failing are forgotten).
    """

    def __init__(self, limiter: EventLog, max_failures: int = 10, window_s: float = 60.0, throttle_s: float = 60.0,
                 metrics: ServerMetrics | None = None, max_clients: int = 10_000):
        self.max_failures, self.window_s, self.throttle_s = max_failures, window_s, throttle_s
        self.metrics, self.max_clients = metrics, max_clients
        self.limiter = limiter  # server.api.connections.RateLimitedLog: failures logged once per interval
        self._failures: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
        self._blocked: dict[tuple[str, str], float] = {}

    def check(self, what: str, ip: str) -> None:
        """429 with Retry-After while (what, ip) is throttled."""
        until = self._blocked.get((what, ip))
        if until is None:
            return
        left = until - time.monotonic()
        if left <= 0:
            del self._blocked[(what, ip)]
            return
        self._count(what, 429)
        raise HTTPException(status_code=429, detail=f"too many failed {what} token checks from {ip}; retry in "
                                                    f"{math.ceil(left)}s", headers={"Retry-After": str(math.ceil(left))})

    def failed(self, what: str, ip: str, status: int) -> None:
        """Count and log a failed check; a wrong token (403) also counts toward throttling `ip`
        (a missing or malformed header, 401, tries no token)."""
        key, now = (what, ip), time.monotonic()
        self._count(what, status)
        self.limiter.event(f"auth-{what}", "%s authentication failed (HTTP %d) from %s", what, status, ip)
        if status != 403:
            return
        times = self._failures.pop(key, None) or deque()
        times.append(now)
        while times and now - times[0] > self.window_s:
            times.popleft()
        self._failures[key] = times
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)
        if len(times) >= self.max_failures:
            self._blocked[key] = now + self.throttle_s
            times.clear()
            log.warning("%s authentication: %s failed %d times within %gs: throttled (429) for %gs", what, ip,
                        self.max_failures, self.window_s, self.throttle_s)
            while len(self._blocked) > self.max_clients:
                self._blocked.pop(next(iter(self._blocked)))

    def succeeded(self, what: str, ip: str) -> None:
        self._failures.pop((what, ip), None)

    def _count(self, what: str, status: int) -> None:
        if self.metrics is not None:
            self.metrics.auth_failures.labels(what=what, status=str(status)).inc()


__all__ = ["AuthGuard"]
