"""RequestGuard: the ASGI middleware in front of every route (body limit, drain, in-flight count).

    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes)   # server.app does it

- A request body over `server.max_body_bytes` is a JSON 413 (`param: "body"`) and is never
  parsed: decided from Content-Length before anything is read, else as soon as the chunks
  received pass the limit. The rest of the body (up to 16x the limit) is read and thrown
  away first, so that the client, still sending, gets the answer instead of a reset
  connection; beyond that the connection is closed. The weights data plane (`/weights/*`, behind the admin token) streams buckets as
  large as the largest tensor and is exempt. (Starlette's own limiter answers a plain-text
  413, which is not this API's error shape.)
- While `app.state.is_draining` (server.lifecycle), new generation requests are answered 503
  with Retry-After and `Connection: close`.
- `app.state.num_inflight` counts generation requests until their last byte is sent.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException

from server.errors import error_body

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
UNLIMITED_PREFIXES = ("/weights/",)
DISCARD_FACTOR = 16


async def _send_json(send: Any, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": data})


def _content_length(scope: dict) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class RequestGuard:
    def __init__(self, app: Any, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    def _too_large(self) -> str:
        return f"body: larger than the limit of {self.max_body_bytes} bytes (server.max_body_bytes)"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, state = scope["path"], scope["app"].state
        is_generation = path in GENERATION_PATHS
        if is_generation and getattr(state, "is_draining", False):
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
        state.num_inflight = getattr(state, "num_inflight", 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.num_inflight -= 1

    async def _discard(self, receive: Any, length: int) -> None:
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

    def _limited(self, receive: Any) -> Any:
        num_bytes = 0

        async def receive_limited() -> dict:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:  # FastAPI re-raises an HTTPException met while reading
                    if message.get("more_body"):
                        await self._discard(receive, 0)
                    raise HTTPException(413, self._too_large())
            return message

        return receive_limited
