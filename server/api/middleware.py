"""RequestGuard: the ASGI middleware in front of every route (body limit, drain, in-flight count).

    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes)   # server.api.app does it

- A request body over `server.max_body_bytes` is a JSON 413 (`param: "body"`) and is never
  parsed: decided from Content-Length before anything is read, else as soon as the chunks
  received pass the limit. The rest of the body (up to 16x the limit) is read and thrown
  away first, so that the client, still sending, gets the answer instead of a reset
  connection; beyond that the connection is closed. The weights data plane (`/weights/*`, behind the admin token) streams buckets as
  large as the largest tensor and is exempt. (Starlette's own limiter answers a plain-text
  413, which is not this API's error shape.)
- While `ServerState.is_draining` (server.api.lifecycle), new generation requests are answered 503
  with Retry-After and `Connection: close`.
- `ServerState.num_inflight` counts generation requests until their last byte is sent.

RequestLog (below) is the outermost layer: `X-Request-Id`, one log event per request.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import BodyTooLarge, error_body
from server.api.state import server_state

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
UNLIMITED_PREFIXES = ("/weights/",)
DISCARD_FACTOR = 16


async def _send_json(send: Send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": data})


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    def _too_large(self) -> str:
        return f"body: larger than the limit of {self.max_body_bytes} bytes (server.max_body_bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, state = scope["path"], server_state(scope["app"])
        is_generation = path in GENERATION_PATHS
        if is_generation and state.is_draining:
            return await _send_json(send, 503, error_body(503, "server is shutting down; retry on another replica"),
                                    [(b"retry-after", b"1")])
        if not path.startswith(UNLIMITED_PREFIXES):
            length = _content_length(scope)
            if length is not None and length > self.max_body_bytes:
                if is_generation:
                    state.metrics.observe_request(path, 413)
                await self._discard(receive, length)
                return await _send_json(send, 413, error_body(413, self._too_large(), "body"))
            receive = self._limited(receive)
        if not is_generation:
            return await self.app(scope, receive, send)
        state.num_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.num_inflight -= 1

    async def _discard(self, receive: Receive, length: int) -> None:
        """Read and drop the rest of a refused body, unless it is (or grows) too large to bother."""
        cap = DISCARD_FACTOR * self.max_body_bytes
        if length > cap:
            return
        num_bytes = 0
        while num_bytes <= cap:
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                return

    def _limited(self, receive: Receive) -> Receive:
        num_bytes = 0

        async def receive_limited() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:  # FastAPI re-raises an HTTP error met while reading
                    if message.get("more_body"):
                        await self._discard(receive, 0)
                    raise BodyTooLarge(self._too_large())
            return message

        return receive_limited


REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
request_log = logging.getLogger("dlrl.request")
QUIET_PATHS = ("/metrics", "/health", "/ready")  # scraped and probed: logged at debug only


class RequestLog:
    """Outermost middleware: the request id, one log event per request, feedback request counts.

    - `X-Request-Id` from the client is kept when it is 1-128 characters of [A-Za-z0-9._:-] (else a
      fresh uuid4 hex replaces it); it is returned on every response and is `request.state.request_id`.
    - One event per request when the response ends: request_id, method, path, status, duration_s
      and the served weight version (`version`); INFO with `server.log_format: json`, else DEBUG
      (uvicorn's access log covers text mode).
    - POST /v1/feedback answers feed dlrl_feedback_received_total / dlrl_feedback_rejected_total.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", ())).get(REQUEST_ID_HEADER, b"")
        rid = given.decode() if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        t0, status = time.perf_counter(), 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._log(scope, rid, status, time.perf_counter() - t0)

    @staticmethod
    def _log(scope: Scope, rid: str, status: int, seconds: float) -> None:
        state, path = server_state(scope["app"]), scope["path"]
        if path == "/v1/feedback":
            state.metrics.observe_feedback_status(status)
        level = logging.INFO if state.config.log_format == "json" and path not in QUIET_PATHS else logging.DEBUG
        if not request_log.isEnabledFor(level):
            return
        request_log.log(level, "%s %s %d %.3fs", scope["method"], path, status, seconds, extra={
            "request_id": rid, "method": scope["method"], "path": path, "status": status,
            "duration_s": round(seconds, 6), "version": state.engine.version})
