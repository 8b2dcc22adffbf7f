"""The FastAPI application of a dlrl server (an API process: HTTP in front of the engine core).

    app = create_app(engine, ServerConfig())        # the engine core on a thread of this process
    app = create_api_app(config, address, index=0, core_pid=pid, on_core_exit=fn)   # an API process of
                                                    # `dlrl serve` (server.core.process), the core elsewhere
    uvicorn.run(app, host="127.0.0.1", port=8000)    # see server/cli.py

Either way the handlers talk to the engine through `server.core.client.CoreClient` (the Engine's
surface over the channel, server.core); with `create_app` the engine core runs on a thread
(server.core.thread), started on startup and stopped on shutdown. State reachable from handlers:
one typed `server.api.state.ServerState` (`server_state(request.app)`: the engine client, config,
metrics, admin and feedback tokens, the tokenizer worker, the recorder, the weight-update glue
(forwarding to the core: server.core.remote_weights), the draining flag and the in-flight count).
Routers: generation (`/generate`, `/v1/*`), feedback (`/v1/feedback`, server.api.routes_feedback),
service (`/health`, `/ready`, `/metrics`, `/admin/*`) `server.api.routes_weights` (`/weights/*`).
`server.api.gate.RefusalGate`, the outermost middleware, refuses before any other work: new
generation requests while draining or with the engine core gone (503), keys and quotas
(server.api.quotas), a full queue (429). `server.api.middleware.RequestGuard` answers bodies over
`server.max_body_bytes` 413 before they are read. `GET /openapi.json` documents every route's
statuses and the served model's limits (server.api.openapi).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from dlrl_config import ConfigError
from server.api import routes_feedback, routes_generate, routes_service, routes_weights
from server.api.auth import resolve_admin_token
from server.api.connections import Refusals
from server.api.gate import install as install_gate
from server.api.handlers import install_error_handlers
from server.api.middleware import RequestGuard, RequestLog
from server.api.openapi import install_openapi
from server.api.state import ServerState, attach
from server.config import ServerConfig
from server.core.client import CoreClient
from server.core.families import to_wire
from server.core.remote_weights import RemoteWeights
from server.engine.engine import Engine, EngineStopped
from server.logs import use_json_logs
from server.metrics import ServerMetrics
from server.recording.recording import Recorder, open_feedback_store

if TYPE_CHECKING:
    from server.core.thread import CoreThread

log = logging.getLogger("dlrl.server")
METRICS_PUSH_S = 1.0  # with several API processes, each sends its families to the core this often


def create_app(engine: Engine, config: ServerConfig | None = None, model_path: str = "") -> FastAPI:
    """The app of `engine`, whose engine core runs on a thread of this process (server.core.thread)."""
    config = config or ServerConfig()
    from server.core.thread import (
        CoreThread,  # the engine in this process (torch): not an API process's import
    )

    core = CoreThread(engine, config, model_path)
    return build_app(CoreClient(core.address, tokenizer=engine.tokenizer), config, core)


def create_api_app(config: ServerConfig, address: str, *, index: int = 0, core_pid: int | None = None,
                   on_core_exit: Callable[[str], None] | None = None, connect_timeout: float = 3600.0) -> FastAPI:
    """The app of an API process whose engine core is another process, at `address` (server.core.process);
    its startup waits for the core (loading a model may take long: its death is seen at once)."""
    client = CoreClient(address, index, core_pid=core_pid, trust_remote_code=config.trust_remote_code,
                        on_core_exit=on_core_exit, connect_timeout=connect_timeout)
    return build_app(client, config)


async def _push_families(st: ServerState) -> None:
    """Several API processes: this one's families to the core, for the others' scrapes (server.core.families)."""
    while True:
        await asyncio.sleep(METRICS_PUSH_S)
        if not st.engine.dead:
            st.engine.push_families(to_wire(st.metrics.families(engine_part=False)))


def build_app(client: CoreClient, config: ServerConfig, core: CoreThread | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        st.executors.install_default(loop)  # bounded, apart from store and weight work
        if core is not None:
            await asyncio.to_thread(core.start)
            core.on_exit(lambda: None if core.stopping else _tell(loop, client, "the engine core stopped"))
        try:
            await client.connect()
        except EngineStopped as e:
            if core is not None:
                raise
            # the engine core exited while loading: its error is dlrl serve's (the supervisor reports it and
            # exits); this process has nothing to serve or clean up yet, so it leaves without a traceback
            log.error("%s before API process %d could connect to it; exiting", e, client.index)
            logging.shutdown()
            os._exit(1)
        pusher = asyncio.ensure_future(_push_families(st)) if config.api_processes > 1 else None
        yield
        if pusher is not None:
            pusher.cancel()
        await client.close()
        if core is not None:
            await asyncio.to_thread(core.stop)
        st.prompts.close()
        if st.recorder is not None:
            st.recorder.close()
        st.executors.shutdown()

    app = FastAPI(title="dlrl server", version="0.1.0", lifespan=lifespan,
                  description="Block-diffusion LM generation (native and OpenAI-compatible) and admin API.")
    st = attach(app, build_state(client, config, core))
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes)
    app.add_middleware(RequestLog)  # X-Request-Id, one log event per request, feedback counts
    install_gate(app, config)  # outermost: draining, keys, quotas, a full queue refused before any other work
    app.include_router(routes_generate.router)
    app.include_router(routes_feedback.router)
    app.include_router(routes_service.router)
    app.include_router(routes_service.admin)
    app.include_router(routes_weights.router)
    install_openapi(app)
    if config.log_format == "json":
        use_json_logs()
    if not st.admin_token:
        log.info("no admin token configured: admin endpoints are disabled")
    return app


def build_state(client: CoreClient, config: ServerConfig, core: CoreThread | None = None) -> ServerState:
    """Everything the handlers reach, each part built whole here (the tokens checked before the store opens)."""
    admin_token = resolve_admin_token(config.admin_token, config.admin_token_file)
    feedback_token = config.resolved_feedback_token()
    if feedback_token and feedback_token == admin_token:
        raise ConfigError("server.feedback_token: must differ from the admin token")
    store = open_feedback_store(config)
    metrics = ServerMetrics(model_name=lambda: client.model_name, store=store)
    return ServerState(client, config, admin_token=admin_token, feedback_token=feedback_token, metrics=metrics,
                       recorder=Recorder.from_config(config, client, store, metrics),
                       weight_updates=RemoteWeights(client),  # the core's WeightUpdates, through the channel
                       refusals=Refusals(config.resource_log_interval_s),  # the gate's (server.api.gate)
                       core_thread=core)


def _tell(loop: asyncio.AbstractEventLoop, client: CoreClient, reason: str) -> None:
    try:
        loop.call_soon_threadsafe(client.core_gone, reason)
    except RuntimeError:  # the loop is closed: the app is gone already
        pass
