"""Admin authentication: a FastAPI dependency checking a bearer token.

    from fastapi import APIRouter, Depends
    from server.auth import require_admin

    router = APIRouter(dependencies=[Depends(require_admin)])

The token comes from `ServerConfig.admin_token`, else the `DLRL_ADMIN_TOKEN`
environment variable, else `ServerConfig.admin_token_file` (a file holding the token;
created with a random token, mode 0600, when missing, so a trainer on the same host can
read it), resolved once by `server.app.create_app` into `app.state.admin_token`. With no token configured the admin endpoints are
disabled (403 "admin disabled"), never open. A missing/malformed header is 401,
a wrong token 403. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import HTTPException, Request

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


def _app_token(request: Request) -> str:
    state = request.app.state
    token = getattr(state, "admin_token", None)
    if token is None:  # app built without create_app (e.g. a bare router in a test)
        config = getattr(state, "config", None)
        token = resolve_admin_token(getattr(config, "admin_token", None), getattr(config, "admin_token_file", None))
    return token


def check_bearer(expected: str, authorization: str | None, what: str = "admin",
                 disabled_hint: str = f"set server.admin_token or {ENV_VAR}") -> None:
    """Raise HTTPException unless `authorization` is `Bearer <expected>` (`what`: whose token)."""
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


async def require_admin(request: Request) -> None:
    """FastAPI dependency: 403 when admin is disabled, 401 missing token, 403 wrong token."""
    check_bearer(_app_token(request), request.headers.get("authorization"))
