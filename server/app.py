"""create_app(engine, config): the FastAPI application of a dlrl server.

    engine = Engine(NativeBackend.from_pretrained(path), max_queue=256, model_name="tiny")
    app = create_app(engine, ServerConfig())
    uvicorn.run(app, host="127.0.0.1", port=8000)    # see server/cli.py

The app starts the engine thread on startup and stops it on shutdown. State reachable
from handlers: `request.app.state.engine`, `.config`, `.metrics`, `.admin_token`,
`.prompts` (the tokenizer worker, server.generation.PromptEncoder), `.is_draining`
(server.lifecycle) and `.num_inflight` (server.middleware). Routers: generation (`/generate`, `/v1/*`), service
(`/health`, `/ready`, `/metrics`, `/admin/*`) and `server.routes_weights`
(`/weights/*`). `server.middleware.RequestGuard` answers bodies over
`server.max_body_bytes` 413 before they are read, and new requests 503 while draining.
`GET /openapi.json` documents every route's statuses and the served model's limits
(server.openapi).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from server import routes_generate, routes_service, routes_weights
from server.auth import resolve_admin_token
from server.config import ServerConfig
from server.engine import Engine
from server.errors import install_error_handlers
from server.generation import PromptEncoder
from server.metrics import ServerMetrics
from server.middleware import RequestGuard
from server.openapi import install_openapi

log = logging.getLogger("dlrl.server")


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from weight_sync.transports.shm import sweep

        sweep()  # shared-memory regions left by pushers that died
        engine.start()
        yield
        engine.shutdown()
        app.state.prompts.close()
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
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes)
    app.include_router(routes_generate.router)
    app.include_router(routes_service.router)
    app.include_router(routes_service.admin)
    app.include_router(routes_weights.router)
    install_openapi(app)
    if not app.state.admin_token:
        log.info("no admin token configured: admin endpoints are disabled")
    return app
