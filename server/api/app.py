"""create_app(engine, config): the FastAPI application of a dlrl server.

    engine = Engine(NativeBackend.from_pretrained(path), max_queue=256, model_name="tiny")
    app = create_app(engine, ServerConfig())
    uvicorn.run(app, host="127.0.0.1", port=8000)    # see server/cli.py

The app starts the engine thread on startup and stops it on shutdown. State reachable
from handlers: one typed `server.api.state.ServerState` (`server_state(request.app)`: the engine,
config, metrics, admin and feedback tokens, the tokenizer worker, the recorder, the weight-update
glue, the draining flag and the in-flight count). Routers: generation (`/generate`, `/v1/*`), feedback
(`/v1/feedback`, server.api.routes_feedback), service
(`/health`, `/ready`, `/metrics`, `/admin/*`) `server.api.routes_weights`
(`/weights/*`). `server.api.gate.RefusalGate`, the outermost middleware, refuses before any other
work: new generation requests while draining (503), keys and quotas (server.api.quotas), a full queue
(429). `server.api.middleware.RequestGuard` answers bodies over `server.max_body_bytes` 413 before
they are read.
`GET /openapi.json` documents every route's statuses and the served model's limits
(server.api.openapi).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from dlrl_config import ConfigError
from server.api import routes_feedback, routes_generate, routes_service, routes_weights
from server.api.auth import resolve_admin_token
from server.api.gate import install as install_gate
from server.api.handlers import install_error_handlers
from server.api.middleware import RequestGuard, RequestLog
from server.api.openapi import install_openapi
from server.api.state import ServerState, attach
from server.config import ServerConfig
from server.engine.engine import Engine
from server.logs import use_json_logs
from server.metrics import ServerMetrics
from server.recording.recording import Recorder
from server.weights.weight_updates import make_updates

log = logging.getLogger("dlrl.server")


def kv_cache_tokens(engine: Engine) -> int:
    """Tokens the KV cache holds (the scheduler's account: pages x tokens per page); unpaged: max_batch x max_len."""
    return engine.scheduler.kv.num_tokens or engine.backend.max_batch * engine.backend.max_len


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from weight_sync.transports.shm import sweep

        sweep()  # shared-memory regions left by pushers that died
        st.executors.install_default(asyncio.get_running_loop())  # bounded, apart from store and weight work
        engine.start()
        if st.weight_updates is not None:
            st.weight_updates.start_capture()  # keep the starting version for rollback
        yield
        engine.shutdown()
        st.prompts.close()
        if st.recorder is not None:
            st.recorder.close()
        if st.weight_updates is not None:
            st.weight_updates.close()
        st.executors.shutdown()

    app = FastAPI(title="dlrl server", version="0.1.0", lifespan=lifespan,
                  description="Block-diffusion LM generation (native and OpenAI-compatible) and admin API.")
    st = attach(app, ServerState(engine, config, metrics=ServerMetrics(engine),
                                 admin_token=resolve_admin_token(config.admin_token, config.admin_token_file),
                                 feedback_token=config.resolved_feedback_token()))
    if st.feedback_token and st.feedback_token == st.admin_token:
        raise ConfigError("server.feedback_token: must differ from the admin token")
    st.recorder = Recorder.from_config(config, engine, st.metrics)
    engine.scheduler.max_queue_tokens = config.max_queue_tokens or 4 * kv_cache_tokens(engine)
    if st.recorder is not None:
        st.metrics.store = st.recorder.store  # store size gauges
    st.weight_updates = make_updates(engine, config)  # the one WeightUpdates (routes_weights uses it)
    st.weight_updates.metrics = st.metrics
    st.weight_updates.executor = st.executors.weights  # server.api.executors: weight work apart from store I/O
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
