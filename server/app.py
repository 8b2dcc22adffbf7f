"""create_app(engine, config): the FastAPI application of a dlrl server.

    engine = Engine(NativeBackend.from_pretrained(path), max_queue=256, model_name="tiny")
    app = create_app(engine, ServerConfig())
    uvicorn.run(app, host="127.0.0.1", port=8000)    # see server/cli.py

The app starts the engine thread on startup and stops it on shutdown. State reachable
from handlers: `request.app.state.engine`, `.config`, `.metrics`, `.admin_token`,
`.prompts` (the tokenizer worker, server.generation.PromptEncoder), `.is_draining`
(server.lifecycle), `.num_inflight` (server.middleware), `.recorder` (server.recording, None
without a store) and `.feedback_token`. Routers: generation (`/generate`, `/v1/*`), feedback
(`/v1/feedback`, server.routes_feedback), service
(`/health`, `/ready`, `/metrics`, `/admin/*`) `server.routes_weights`
(`/weights/*`). `server.middleware.RequestGuard` answers bodies over
`server.max_body_bytes` 413 before they are read, and new requests 503 while draining.
`GET /openapi.json` documents every route's statuses and the served model's limits
(server.openapi).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from dlrl_config import ConfigError
from server import routes_feedback, routes_generate, routes_service, routes_weights
from server.auth import resolve_admin_token
from server.config import ServerConfig
from server.engine import Engine
from server.errors import install_error_handlers
from server.generation import PromptEncoder
from server.logs import use_json_logs
from server.metrics import ServerMetrics
from server.middleware import RequestGuard, RequestLog
from server.openapi import install_openapi
from server.quotas import install as install_quotas
from server.recording import Recorder
from server.weight_updates import make_updates

log = logging.getLogger("dlrl.server")


def kv_cache_tokens(backend) -> int:
    """Tokens the backend's KV cache holds (its pages x tokens per page); else max_batch x max_len."""
    plan = getattr(backend, "kv_plan", None)
    if plan is not None:
        return int(plan.num_pages * plan.page_tokens)
    return int(getattr(backend, "max_batch", 1) * backend.max_len)


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from weight_sync.transports.shm import sweep

        sweep()  # shared-memory regions left by pushers that died
        engine.start()
        updates = getattr(app.state, "weight_updates", None)
        if updates is not None:
            updates.start_capture()  # keep the starting version for rollback
        yield
        engine.shutdown()
        app.state.prompts.close()
        if app.state.recorder is not None:
            app.state.recorder.close()
        updates = getattr(app.state, "weight_updates", None)
        if updates is not None:
            updates.close()

    app = FastAPI(title="dlrl server", version="0.1.0", lifespan=lifespan,
                  description="Block-diffusion LM generation (native and OpenAI-compatible) and admin API.")
    app.state.engine = engine
    app.state.config = config
    app.state.admin_token = resolve_admin_token(config.admin_token, config.admin_token_file)
    app.state.metrics = ServerMetrics(engine)
    app.state.prompts = PromptEncoder(engine.tokenizer, engine.max_model_len)
    app.state.is_draining, app.state.num_inflight = False, 0
    app.state.feedback_token = config.resolved_feedback_token()
    if app.state.feedback_token and app.state.feedback_token == app.state.admin_token:
        raise ConfigError("server.feedback_token: must differ from the admin token")
    app.state.recorder = Recorder.from_config(config, engine, app.state.metrics)
    engine.scheduler.max_queue_tokens = config.max_queue_tokens or 4 * kv_cache_tokens(engine.backend)
    if app.state.recorder is not None:
        app.state.metrics.store = app.state.recorder.store  # store size gauges
    app.state.weight_updates = make_updates(engine, config)  # keep_versions=0: nothing kept
    app.state.weight_updates.metrics = app.state.metrics
    install_error_handlers(app)
    install_quotas(app, config)  # inside RequestGuard: a draining server or a too large body is refused first
    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes)
    app.add_middleware(RequestLog)  # outermost: X-Request-Id, one log event per request, feedback counts
    app.include_router(routes_generate.router)
    app.include_router(routes_feedback.router)
    app.include_router(routes_service.router)
    app.include_router(routes_service.admin)
    app.include_router(routes_weights.router)
    install_openapi(app)
    if config.log_format == "json":
        use_json_logs()
    if not app.state.admin_token:
        log.info("no admin token configured: admin endpoints are disabled")
    return app
