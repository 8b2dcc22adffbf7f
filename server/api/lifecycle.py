"""Graceful shutdown: SIGTERM drains in-flight requests, answers new ones 503, then exits 0.

    GracefulServer(uvicorn.Config(app, ...), app, shutdown_timeout=20).run()   # server.cli

On the first SIGTERM or SIGINT the server starts draining: `/ready` answers 503 (so a
load balancer stops sending), new generation requests are answered 503 with
`Retry-After` and `Connection: close` (server.api.gate.RefusalGate), and requests
already in flight run to the end.
When none is left -- or `server.shutdown_timeout` seconds have passed, after which the
remaining sequences are aborted (their responses end with finish_reason "abort") -- uvicorn
closes the listeners and the process exits with status 0, as Kubernetes expects. A
second signal stops at once. With a `limiter` (server.api.connections.RateLimitedLog) the event
loop's resource errors (accept() out of file descriptors) are logged once per interval.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette

from server.api.connections import RateLimitedLog, install_resource_log
from server.api.state import ServerState, server_state

if TYPE_CHECKING:
    from server.config import ServerConfig

log = logging.getLogger("dlrl.server")
ABORT_GRACE_S = 5.0  # after aborting, how long responses may take to finish sending


async def _wait_idle(state: ServerState, deadline: float) -> bool:
    while state.num_inflight > 0:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def drain(app: Starlette, timeout: float) -> None:
    """Stop admitting, let in-flight requests finish (at most `timeout` s), then abort the rest."""
    state = server_state(app)
    state.is_draining = True
    log.info("draining: %d request(s) in flight, waiting up to %gs", state.num_inflight, timeout)
    if await _wait_idle(state, time.monotonic() + timeout):
        log.info("drained: no request in flight")
        return
    num = state.engine.abort_all()
    log.warning("shutdown deadline (%gs) passed: aborted %d request(s) still running", timeout, num)
    if not await _wait_idle(state, time.monotonic() + ABORT_GRACE_S):
        log.warning("%d response(s) still sending after the abort; closing anyway", state.num_inflight)


def http_server(app: Starlette, config: ServerConfig, on_started: Callable[[], None] | None = None) -> GracefulServer:
    """The uvicorn server `dlrl serve` runs `app` with: bounded connections (server.api.connections: ConfigError
    when the file limit leaves no room), server.http / server.loop, keep-alive, backlog, logs."""
    from server.api.connections import ConnectionLimits, bounded_protocol

    limits = ConnectionLimits.from_config(config, server_state(app).metrics)
    http, loop = config.resolved_http(), config.resolved_loop()
    log.info("HTTP protocol %s on the %s event loop (server.http=%s, server.loop=%s)", http, loop, config.http,
             config.loop)
    json_logs: dict[str, Any] = {  # uvicorn.Config keyword arguments (each typed differently there)
        "log_config": None, "access_log": False} if config.log_format == "json" else {}
    return GracefulServer(uvicorn.Config(app, host=config.host, port=config.port, loop=loop,
                                         http=bounded_protocol(limits, http),
                                         # uvicorn annotates an int but hands it to loop.call_later: seconds as float
                                         timeout_keep_alive=config.keepalive_timeout_s,  # type: ignore[arg-type]
                                         backlog=config.listen_backlog, **json_logs,
                                         log_level=config.log_level.lower(), timeout_graceful_shutdown=5),
                          app, shutdown_timeout=config.shutdown_timeout, limiter=limits.limiter, on_started=on_started)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains (see module doc) instead of stopping."""

    def __init__(self, config: uvicorn.Config, app: Starlette, shutdown_timeout: float,
                 limiter: RateLimitedLog | None = None, on_started: Callable[[], None] | None = None):
        super().__init__(config)
        self.app, self.shutdown_timeout = app, shutdown_timeout
        self.limiter = limiter  # server.api.connections.RateLimitedLog: resource errors once per interval
        self.on_started = on_started  # told once the app started and the listeners accept (server.core.process)
        self._drain_signal: int | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.limiter is not None:
            install_resource_log(asyncio.get_running_loop(), self.limiter)
        await super().startup(sockets=sockets)
        if self.on_started is not None and self.started:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:  # signal handler: only set flags
        if self._drain_signal is None:
            self._drain_signal = sig
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.limiter is not None and counter % 10 == 0:
            self.limiter.flush()  # counts held back by the once-per-interval logs
            state = server_state(self.app)
            if state.auth_guard is not None:
                state.auth_guard.limiter.flush()
            if state.refusals is not None:  # server.api.gate: refusals logged once per interval
                state.refusals.flush()
        if self._drain_signal is not None and self._drain_task is None:
            log.info("received %s: shutting down gracefully", signal.Signals(self._drain_signal).name)
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        try:
            await drain(self.app, self.shutdown_timeout)
        finally:
            self.should_exit = True
