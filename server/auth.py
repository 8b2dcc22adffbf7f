"""Admin authentication: a FastAPI dependency checking a bearer token.

    from fastapi import APIRouter, Depends
    from server.auth import require_admin

    router = APIRouter(dependencies=[Depends(require_admin)])

The token comes from `ServerConfig.admin_token`, else the `DLRL_ADMIN_TOKEN`
environment variable, else `ServerConfig.admin_token_file` (a file holding the token;
created with a random token, mode 0600, when missing, so a trainer on the same host can
read it), resolved once by `server.app.create_app` into `ServerState.admin_token`. With no token configured the admin endpoints are
disabled (403 "admin disabled"), never open. A missing/malformed header is 401,
a wrong token 403. Tokens are compared in constant time. Failures are counted
(`dlrl_auth_failures_total{what,status}`), logged at most once per
`server.resource_log_interval_s` with a count, and a client address with
`server.auth_max_failures` wrong tokens (403) within `server.auth_failure_window_s` gets 429 with
Retry-After for `server.auth_throttle_s`, before its token is compared (AuthGuard; the
feedback token of server.routes_feedback goes through the same check).
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import secrets
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import HTTPException, Request
from starlette.applications import Starlette

from server.state import server_state

if TYPE_CHECKING:
    from server.metrics import ServerMetrics

ENV_VAR = "DLRL_ADMIN_TOKEN"
log = logging.getLogger("dlrl.server")


def resolve_admin_token(configured: str | None, token_file: str | None = None) -> str:
    """The effective admin token: the configured one, else the env var, else the token
    file (created with a random token if missing), else "" (disabled)."""
    token = (configured or os.environ.get(ENV_VAR, "") or "").strip()
    if token or not token_file:
        return token
    path = Path(token_file)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
    return path.read_text().strip()


class AuthGuard:
    """Failed token checks per (token kind, client address): counted, logged (rate-limited), throttled.

    A client with `max_failures` failures within `window_s` gets 429 with Retry-After for
    `throttle_s`, before its token is even compared; a success clears its failures.
    At most `max_clients` addresses are tracked (the least recently failing are forgotten).
    """

    def __init__(self, max_failures: int = 10, window_s: float = 60.0, throttle_s: float = 60.0,
                 log_interval_s: float = 10.0, metrics: ServerMetrics | None = None, max_clients: int = 10_000):
        from server.connections import RateLimitedLog

        self.max_failures, self.window_s, self.throttle_s = max_failures, window_s, throttle_s
        self.metrics, self.max_clients = metrics, max_clients
        self.limiter = RateLimitedLog(log_interval_s)
        self._failures: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
        self._blocked: dict[tuple[str, str], float] = {}

    @classmethod
    def from_app(cls, app: Starlette) -> AuthGuard:
        st = server_state(app)
        if st.auth_guard is None:
            c = st.config
            st.auth_guard = cls(c.auth_max_failures, c.auth_failure_window_s, c.auth_throttle_s,
                                c.resource_log_interval_s, st.metrics)
        return st.auth_guard

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


def _compare(expected: str, authorization: str | None, what: str, disabled_hint: str) -> None:
    if not expected:
        raise HTTPException(status_code=403, detail=f"{what} disabled: no {what} token configured ({disabled_hint})")
    if not authorization:
        raise HTTPException(status_code=401, detail="missing bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise HTTPException(status_code=401, detail="malformed Authorization header (expected 'Bearer <token>')",
                            headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise HTTPException(status_code=403, detail=f"invalid {what} token")


def check_bearer(expected: str, authorization: str | None, what: str = "admin",
                 disabled_hint: str = f"set server.admin_token or {ENV_VAR}", request: Request | None = None) -> None:
    """Raise HTTPException unless `authorization` is `Bearer <expected>` (`what`: whose token).
    With `request`, failures are counted, logged and throttled per client (AuthGuard of the app)."""
    if request is None:
        return _compare(expected, authorization, what, disabled_hint)
    guard, ip = AuthGuard.from_app(request.app), request.client.host if request.client else ""
    guard.check(what, ip)
    try:
        _compare(expected, authorization, what, disabled_hint)
    except HTTPException as e:
        if expected:  # "disabled" is the server's state, not the client's failure
            guard.failed(what, ip, e.status_code)
        raise
    guard.succeeded(what, ip)


async def require_admin(request: Request) -> None:
    """FastAPI dependency: 403 when admin is disabled, 401 missing token, 403 wrong token, 429 throttled."""
    check_bearer(server_state(request.app).admin_token, request.headers.get("authorization"), request=request)
