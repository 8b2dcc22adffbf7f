"""RefusalGate: the outermost ASGI middleware; refusals decided from the request line and headers alone.

    install(app, config)   # server.api.app: added last (app.add_middleware(RefusalGate, ...)), so it runs first

Before the body is read or parsed, before routing, pydantic and the per-request log
(server.api.middleware.RequestLog), the gate answers:
- generation routes (`/generate`, `/v1/completions`, `/v1/chat/completions`):
  503 + Retry-After while the server drains (server.api.lifecycle) or once the engine core is gone
  (naming why: server.core.client); with API keys
  (server.api.quotas) 401 / 403 for a missing / unknown key and 429 + Retry-After over the key's
  request rate or concurrency cap; 429 + Retry-After when the engine's waiting queue is full
  (back-pressure: `server.max_queue` sequences wait, as the engine core's last load says; Retry-After from
  the work ahead, server.engine.retry_after: the core's forecast, this process's bookings);
- `POST /v1/feedback`: 429 over `server.max_concurrent_feedback` calls in flight.
A refusal costs one JSON error body and the HTTP exchange: it is counted
(`dlrl_requests_total{endpoint,status}` for generation routes, `dlrl_feedback_rejected_total`
for feedback) and logged once per `server.resource_log_interval_s` with a count
(`Refusals`), not once per request: it is left out of uvicorn's access log (`quiet_access_log`)
and carries no X-Request-Id. A refused request whose body is small (<= 64 KiB, with a
Content-Length) keeps its connection alive, as a flooding client would otherwise reconnect
for every refusal; a larger or chunked one is answered `Connection: close`.
What the request sends later (its token rate: server.api.quotas.charge_tokens, the token bound of the
queue: server.engine.scheduler) is checked once the body is parsed.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.connections import Refusals
from server.api.errors import APIError, error_body
from server.api.middleware import GENERATION_PATHS
from server.api.quotas import Quotas, current_key, limited, load_keys
from server.api.state import ServerState, server_state

if TYPE_CHECKING:
    from server.config import ServerConfig

FEEDBACK_PATH = "/v1/feedback"
KEEPALIVE_BODY_BYTES = 64 * 1024  # a refused request's body up to this size is left to the HTTP parser
_refusing: contextvars.ContextVar[bool] = contextvars.ContextVar("dlrl_refusing", default=False)
log = logging.getLogger("dlrl.server")


class _AccessLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _refusing.get()


def quiet_access_log() -> None:
    """Leave the gate's refusals out of uvicorn's access log (once per process)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _AccessLogFilter) for f in access.filters):
        access.addFilter(_AccessLogFilter())


class RefusalGate:
    """The refusals of the module doc, answered before anything else of the app runs."""

    def __init__(self, app: ASGIApp, quotas: Quotas | None = None):
        self.app, self.quotas = app, quotas

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in GENERATION_PATHS:
            return await self._generation(scope, receive, send)
        if path == FEEDBACK_PATH and self.quotas is not None and self.quotas.max_feedback:
            return await self._feedback(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _generation(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = server_state(scope["app"])
        if state.is_draining:
            return await self._refuse(scope, send, APIError(503, "server is shutting down; retry on another replica",
                                                            None, {"Retry-After": "1"}), "draining", close=True)
        if state.engine.dead:
            return await self._refuse(scope, send, APIError(503, f"{state.engine.dead}; this server is stopping",
                                                            None, {"Retry-After": "1"}), "engine core gone", close=True)
        key = None
        if self.quotas is not None and self.quotas.keys:
            try:
                key = self.quotas.identify(_header(scope, b"authorization"))
            except APIError as e:
                return await self._refuse(scope, send, e, "api key")
        if key is None or isinstance(key, str):  # no keys, or the admin token (no limits)
            full = _queue_full(state)
            if full is not None:
                return await self._refuse(scope, send, full, "queue full")
            return await self.app(scope, receive, send)
        quotas = self.quotas
        assert quotas is not None
        try:
            quotas.admit(key)  # over its own quota: refused without booking a place in the queue
        except APIError as e:
            return await self._refuse(scope, send, e, f"key {key.name}")
        full = _queue_full(state)
        if full is not None:
            quotas.release(key)
            return await self._refuse(scope, send, full, "queue full")
        token = current_key.set(key)
        try:
            await self.app(scope, receive, send)
        finally:
            current_key.reset(token)
            quotas.release(key)

    async def _feedback(self, scope: Scope, receive: Receive, send: Send) -> None:
        q = self.quotas
        assert q is not None
        if not q.take_feedback():
            return await self._refuse(scope, send, limited(f"{q.feedback_in_flight} feedback calls in flight "
                                                           f"(server.max_concurrent_feedback={q.max_feedback})", 1.0),
                                      "feedback cap")
        try:
            await self.app(scope, receive, send)
        finally:
            q.give_feedback()

    async def _refuse(self, scope: Scope, send: Send, e: APIError, cause: str, close: bool = False) -> None:
        state = server_state(scope["app"])
        path = scope["path"]
        if path == FEEDBACK_PATH:
            state.metrics.observe_feedback_status(e.status)
        else:
            state.metrics.observe_request(path, e.status)
        if state.refusals is not None:
            state.refusals.count(path, e.status, cause, e.message)
        _refusing.set(True)  # this request's task only: uvicorn's access log leaves it out
        headers = [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
        await _send(send, e.status, error_body(e.status, e.message, e.param), headers, close or _must_close(scope))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _must_close(scope: Scope) -> bool:
    """Close after a refusal unless the unread body is small and announced (no 100-continue)."""
    length, expect = None, False
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            length = int(value) if value.isdigit() else None
            if length is None:
                return True
        elif key == b"transfer-encoding" or (key == b"expect" and value.lower() == b"100-continue"):
            expect = True
    return expect or (length is not None and length > KEEPALIVE_BODY_BYTES)


def _queue_full(state: ServerState) -> APIError | None:
    """429 when the engine's waiting queue cannot take one more sequence (Retry-After from the work ahead)."""
    sched = state.engine.scheduler
    waiting, bound = sched.num_waiting, sched.max_queue
    if waiting < bound:
        return None
    wait = sched.retry_after(waiting + 1 - bound, 0)
    return APIError(429, f"queue full: {waiting} sequences waiting (max_queue={bound}); retry later", None,
                    {"Retry-After": str(wait)})


async def _send(send: Send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]], close: bool) -> None:
    data = json.dumps(body).encode()
    extra = [(b"connection", b"close")] if close else []
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers, *extra]})
    await send({"type": "http.response.body", "body": data})


__all__ = ["RefusalGate", "Refusals", "quiet_access_log"]


def install(app: FastAPI, config: ServerConfig) -> None:
    """Add the RefusalGate, outermost: keys and the feedback cap when configured, the draining 503 and the
    back-pressure 429 always. Call after every other add_middleware."""
    st = server_state(app)
    keys = load_keys(config.api_keys_file)
    share = 1.0 / config.api_processes if config.engine_core == "process" else 1.0  # quotas: each its part
    quotas = (Quotas(keys, st.admin_token, st.feedback_token, config.max_concurrent_feedback, share)
              if keys or config.max_concurrent_feedback else None)
    quiet_access_log()
    app.add_middleware(RefusalGate, quotas=quotas)
