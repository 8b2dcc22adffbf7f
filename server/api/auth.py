"""Admin authentication: a FastAPI dependency checking a bearer token.

    from fastapi import APIRouter, Depends
    from server.api.auth import require_admin

    router = APIRouter(dependencies=[Depends(require_admin)])

The token comes from `ServerConfig.admin_token`, else the `DLRL_ADMIN_TOKEN`
environment variable, else `ServerConfig.admin_token_file` (a file holding the token;
created with a random token, mode 0600, when missing, so a trainer on the same host can
read it), resolved once by `server.api.app.create_app` into `ServerState.admin_token`. With no token configured the admin endpoints are
disabled (403 "admin disabled"), never open. A missing/malformed header is 401,
a wrong token 403. Tokens are compared in constant time. Failures are counted
(`dlrl_auth_failures_total{what,status}`), logged at most once per
`server.resource_log_interval_s` with a count, and a client address with
`server.auth_max_failures` wrong tokens (403) within `server.auth_failure_window_s` gets 429 with
Retry-After for `server.auth_throttle_s`, before its token is compared (AuthGuard; the
feedback token of server.api.routes_feedback goes through the same check; the guard itself lives in
server/api/auth_guard.py).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import HTTPException, Request
from starlette.applications import Starlette

from server.api.auth_guard import AuthGuard
from server.api.connections import RateLimitedLog
from server.api.state import server_state

ENV_VAR = "DLRL_ADMIN_TOKEN"


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


def auth_guard(app: Starlette) -> AuthGuard:
    """The AuthGuard of `app` (`ServerState.auth_guard`), built from its config on first use."""
    st = server_state(app)
    if st.auth_guard is None:
        c = st.config
        st.auth_guard = AuthGuard(RateLimitedLog(c.resource_log_interval_s), c.auth_max_failures,
                                  c.auth_failure_window_s, c.auth_throttle_s, st.metrics)
    return st.auth_guard


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
        _compare(expected, authorization, what, disabled_hint)
        return
    guard, ip = auth_guard(request.app), request.client.host if request.client else ""
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
