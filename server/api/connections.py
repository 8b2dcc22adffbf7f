"""Bounds on the server's TCP connections: header and read timeouts, caps, a reserve for probes and admin.

    limits = ConnectionLimits.from_config(config, metrics)        # server.cli
    uvicorn.Config(app, http=bounded_protocol(limits, config.resolved_http()), loop=config.resolved_loop(),
                   timeout_keep_alive=config.keepalive_timeout_s, backlog=config.listen_backlog, ...)

uvicorn bounds neither a request whose headers arrive one byte at a time nor how many
connections are open; `ConnectionBounds`, a mixin of uvicorn's protocols (`BoundedH11Protocol`:
h11, pure Python; `BoundedHttpToolsProtocol`: httptools, a C parser, about half the CPU per
request -- `server.http`), adds:
- header timeout: a request's line and headers must be complete within
  `server.header_timeout_s` of its first byte (of the connection opening, for the first
  request), else the connection gets a 408 and is closed;
- header size: a request line and headers over 16 KiB (`MAX_HEADER_BYTES`) are a 431 and the
  connection is closed (h11 bounds them itself at the same size, with a 400; httptools does not);
- read timeout: a request body that stalls (no byte while the server is ready to read) for
  `server.read_timeout_s` is a 408 and the connection is closed;
- idle keep-alive: uvicorn's own `timeout_keep_alive` (`server.keepalive_timeout_s`);
- caps: at most `server.max_connections` open connections (lowered at start so that they,
  the reserve and `server.fd_reserve` descriptors fit in the file limit, RLIMIT_NOFILE),
  and `server.max_connections_per_ip` per client address. Past them a connection may take
  one of `server.reserved_connections` slots (at most a quarter of them per client), which
  serve only /health, /ready, /metrics, /weights/* and /admin/* -- any other request there
  is a 503 -- so probes and the trainer still get an answer under a flood. Past those the
  connection gets an immediate 503 (`Connection: close`) and is closed.
Refusals and timeouts count in `dlrl_connections_refused_total{reason}` and are logged at
most once per `server.resource_log_interval_s` with a count (`RateLimitedLog`), as are the
event loop's "socket.accept() out of system resource" errors (`install_resource_log`; asyncio's
loop only: uvloop's libuv sheds connections it cannot accept without reporting them -- the caps
above keep the server below the file limit either way).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import resource
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, cast

from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from dlrl_config import ConfigError
from server.api.errors import error_body

if TYPE_CHECKING:
    from server.config import ServerConfig
    from server.metrics import ServerMetrics

log = logging.getLogger("dlrl.server")
RESERVED_PATHS = ("/health", "/ready", "/metrics")
RESERVED_PREFIXES = ("/weights/", "/admin/")
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
MAX_HEADER_BYTES = 16 * 1024  # a request line + headers; h11's own bound (uvicorn's h11_max_incomplete_event_size)


class RateLimitedLog:
    """Log an event at most once per `interval_s` per key, with how many happened since the last line.

        limiter.event("refused", "refused connection from %s (%s)", ip, why)   # first: logged at once
        limiter.flush()                                                        # (periodic) report the rest
    """

    def __init__(self, interval_s: float, logger: logging.Logger = log, level: int = logging.WARNING):
        self.interval_s, self.logger, self.level = interval_s, logger, level
        self._last: dict[str, float] = {}
        self._pending: dict[str, tuple[int, str, tuple]] = {}

    def event(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        count = self._pending.pop(key, (0, msg, args))[0] + 1
        if now - self._last.get(key, -1e18) >= self.interval_s:
            self._emit(key, count, msg, args, now)
        else:
            self._pending[key] = (count, msg, args)

    def _emit(self, key: str, count: int, msg: str, args: tuple, now: float) -> None:
        self._last[key] = now
        suffix = "" if count == 1 else f" ({count} times in the last {self.interval_s:g}s; logged once per interval)"
        self.logger.log(self.level, msg + suffix, *args)

    def flush(self) -> None:
        """Log what was held back once its interval has passed (call periodically)."""
        now = time.monotonic()
        for key in [k for k in self._pending if now - self._last.get(k, -1e18) >= self.interval_s]:
            count, msg, args = self._pending.pop(key)
            self._emit(key, count, msg, args, now)


class Refusals:
    """Refusals counted (metrics) and logged once per interval per (path, status, cause)."""

    def __init__(self, interval_s: float = 10.0):
        self.limiter = RateLimitedLog(interval_s)
        self.counts: dict[tuple[str, int], int] = {}

    def count(self, path: str, status: int, cause: str, message: str) -> None:
        key = (path, status)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.limiter.event(f"refused {path} {status} {cause}", "refused %s %d: %s", path, status, message)

    def flush(self) -> None:
        self.limiter.flush()


def install_resource_log(loop: asyncio.AbstractEventLoop, limiter: RateLimitedLog) -> None:
    """Route the loop's resource errors (accept() out of file descriptors, ...) through `limiter`."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            limiter.event(f"resource-{exc.errno}", "%s: %s; lower server.max_connections or raise the file limit "
                          "(ulimit -n)", context.get("message", "out of system resource"), exc)
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _nofile() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class ConnectionLimits:
    """Open connections per client address and in total; `admit` decides a new one's slot."""

    def __init__(self, max_connections: int, max_per_ip: int, reserved: int, header_timeout_s: float,
                 read_timeout_s: float, log_interval_s: float = 10.0, metrics: ServerMetrics | None = None):
        self.max_connections, self.max_per_ip, self.reserved = max_connections, max_per_ip, reserved
        self.reserve_per_ip = max(1, reserved // 4)
        self.header_timeout_s, self.read_timeout_s = header_timeout_s, read_timeout_s
        self.limiter = RateLimitedLog(log_interval_s)
        self.metrics = metrics
        self.num_open = self.num_reserve = 0
        self._per_ip: Counter[str] = Counter()
        self._reserve_per_ip: Counter[str] = Counter()

    @classmethod
    def from_config(cls, config: ServerConfig, metrics: ServerMetrics | None = None,
                    nofile: int | None = None) -> ConnectionLimits:
        """Caps of `config` (server.*), max_connections lowered to fit the file limit (ConfigError if nothing fits)."""
        nofile = nofile or _nofile()
        room = nofile - config.fd_reserve - config.reserved_connections
        if room < 1:
            raise ConfigError(f"server.fd_reserve: the file limit (ulimit -n) is {nofile}: no room for connections "
                              f"after fd_reserve={config.fd_reserve} and reserved_connections="
                              f"{config.reserved_connections}; raise the limit or lower these")
        cap = min(config.max_connections, room)
        if cap < config.max_connections:
            log.warning("server.max_connections lowered from %d to %d: the file limit (ulimit -n) is %d, "
                        "server.fd_reserve %d, server.reserved_connections %d", config.max_connections, cap, nofile,
                        config.fd_reserve, config.reserved_connections)
        return cls(cap, config.max_connections_per_ip, config.reserved_connections, config.header_timeout_s,
                   config.read_timeout_s, config.resource_log_interval_s, metrics)

    def admit(self, ip: str) -> str | None:
        """"normal", "reserve" (probes and admin only) or None (refuse); counted until `release`."""
        if self.num_open < self.max_connections and self._per_ip[ip] < self.max_per_ip:
            self.num_open += 1
            self._per_ip[ip] += 1
            return "normal"
        if self.num_reserve < self.reserved and self._reserve_per_ip[ip] < self.reserve_per_ip:
            self.num_reserve += 1
            self._reserve_per_ip[ip] += 1
            return "reserve"
        return None

    def release(self, ip: str, slot: str) -> None:
        if slot == "normal":
            self.num_open -= 1
            self._per_ip[ip] -= 1
            if self._per_ip[ip] <= 0:
                del self._per_ip[ip]
        elif slot == "reserve":
            self.num_reserve -= 1
            self._reserve_per_ip[ip] -= 1
            if self._reserve_per_ip[ip] <= 0:
                del self._reserve_per_ip[ip]

    def per_ip(self, ip: str) -> int:
        return self._per_ip[ip]

    def refused(self, reason: str, ip: str, what: str) -> None:
        """Count (dlrl_connections_refused_total{reason}) and log, rate-limited, a refusal or timeout."""
        if self.metrics is not None:
            self.metrics.connections_refused.labels(reason=reason).inc()
        self.limiter.event(f"conn-{reason}", "connection from %s closed: %s", ip, what)


def _raw_response(status: int, reason: str, message: str, extra: bytes = b"") -> bytes:
    import json

    body = json.dumps(error_body(status, message)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n").encode() + extra + b"\r\n" + body


def _is_reserved(path: str) -> bool:
    return path in RESERVED_PATHS or path.startswith(RESERVED_PREFIXES)


def reserve_only(app: ASGI3Application) -> ASGI3Application:
    """ASGI wrapper of a connection in a reserved slot: only probes and admin routes, else 503."""

    async def wrapped(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http" or _is_reserved(scope["path"]):
            await app(scope, receive, send)
            return
        body = error_body(503, "too many connections: this server's connection limit is reached "
                               "(server.max_connections / max_connections_per_ip); retry later")
        import json

        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})

    return wrapped


class ConnectionBounds(asyncio.Protocol):
    """The header/read timeouts and connection caps of the module doc, for any of uvicorn's HTTP/1.1 protocols.

    A mixin placed before the uvicorn protocol class (`BoundedH11Protocol`, `BoundedHttpToolsProtocol`); it relies
    on what both of uvicorn's protocols (0.54) share: `self.cycle` is replaced by a new `RequestResponseCycle` when
    a request's headers are complete (inside `data_received`), the cycle's `more_body` turns False once its body is
    complete, `response_started` / `response_complete` track the response, `self.flow.read_paused` says the app
    is not reading, and `self.client`, `self.loop`, `self.app`, `self.transport` are set by `connection_made`.
    """

    limits: ConnectionLimits  # set by bounded_protocol()
    # provided by the uvicorn protocol this is mixed into
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None
    flow: FlowControl
    app: ASGI3Application
    cycle: Any  # that protocol's RequestResponseCycle (h11_impl's or httptools_impl's), None before the first request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvicorn serves HTTP/1.1 over stream (TCP) transports
        super().connection_made(transport)
        self._ip = self.client[0] if self.client else ""
        self._header_timer: asyncio.TimerHandle | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._last_rx = self.loop.time()
        self._seen_cycle: object = None
        self._slot = self.limits.admit(self._ip)
        if self._slot is None:
            self.limits.refused("limit", self._ip, f"too many connections ({self.limits.num_open} open, "
                                f"{self.limits.per_ip(self._ip)} from this client; reserve full)")
            transport.write(_raw_response(503, "Service Unavailable", "too many connections: this server's "
                                          "connection limit is reached; retry later", b"retry-after: 1\r\n"))
            transport.close()
            return
        if self._slot == "reserve":
            self.app = reserve_only(self.app)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._read_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._read_timer = None
        if self._slot is not None:
            self.limits.release(self._ip, self._slot)
            self._slot = None
        super().connection_lost(exc)

    # ---------------------------------------------------------------- timeouts
    def _arm_header_timer(self) -> None:
        self._header_bytes = 0
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._on_header_timeout)

    def _idle_between_requests(self) -> bool:
        return self.cycle is None or bool(self.cycle.response_complete)

    def data_received(self, data: bytes) -> None:
        self._last_rx = self.loop.time()
        if self._header_timer is None and self._idle_between_requests():
            self._arm_header_timer()  # the first byte of the next request on a kept-alive connection
        if self._header_timer is not None:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._header_timer is not None and self._header_bytes > MAX_HEADER_BYTES and self.cycle is self._seen_cycle:
            self._close_with_status(431, "Request Header Fields Too Large", "header_size", f"request line and "
                                    f"headers over {MAX_HEADER_BYTES} bytes")  # h11 has this bound, httptools not
            return
        if self.cycle is not None and self.cycle is not self._seen_cycle:  # a request's headers are complete
            self._seen_cycle = self.cycle
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            if self.cycle.more_body and self._read_timer is None:
                self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._on_read_check)

    def _close_with_status(self, status: int, phrase: str, reason: str, what: str) -> None:
        if self.transport.is_closing():
            return
        self.limits.refused(reason, self._ip, what)
        if self._idle_between_requests() or not self.cycle.response_started:
            self.transport.write(_raw_response(status, phrase, what))
        self.transport.close()

    def _close_with_408(self, reason: str, what: str) -> None:
        self._close_with_status(408, "Request Timeout", reason, what)

    def _on_header_timeout(self) -> None:  # armed while a request's headers are awaited, cancelled once complete
        self._header_timer = None
        self._close_with_408("header_timeout", f"request headers not complete within "
                                               f"{self.limits.header_timeout_s:g}s (server.header_timeout_s)")

    def _on_read_check(self) -> None:
        self._read_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete or self.transport.is_closing():
            return  # the body is complete (or the response was sent): nothing to wait for
        idle = self.loop.time() - self._last_rx
        if self.flow.read_paused or idle < self.limits.read_timeout_s:  # paused: the app is the slow side
            delay = self.limits.read_timeout_s - (0 if self.flow.read_paused else idle)
            self._read_timer = self.loop.call_later(max(delay, 0.05), self._on_read_check)
            return
        self._close_with_408("read_timeout", f"request body stalled for {self.limits.read_timeout_s:g}s "
                                             "(server.read_timeout_s)")


class BoundedH11Protocol(ConnectionBounds, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the bounds of `ConnectionBounds`."""


@functools.cache
def _httptools_protocol() -> type[ConnectionBounds]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # needs httptools (the server extra)

    class BoundedHttpToolsProtocol(ConnectionBounds, HttpToolsProtocol):
        """uvicorn's httptools protocol (C parser, about twice as fast per request) with the same bounds."""

    return BoundedHttpToolsProtocol


def bounded_protocol(limits: ConnectionLimits, http: str = "h11") -> type[ConnectionBounds]:
    """The bounded protocol class for `http` ("h11" or "httptools") bound to `limits` (uvicorn.Config(http=...))."""
    if http not in ("h11", "httptools"):
        raise ValueError(f"http must be 'h11' or 'httptools', not {http!r}")
    base = BoundedH11Protocol if http == "h11" else _httptools_protocol()
    return type(base.__name__, (base,), {"limits": limits})


__all__ = ["BoundedH11Protocol", "ConnectionBounds", "ConnectionLimits", "RateLimitedLog", "Refusals", "bounded_protocol",
           "install_resource_log",
           "reserve_only"]
