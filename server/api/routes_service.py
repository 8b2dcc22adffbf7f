"""Service routes: health, readiness, Prometheus metrics, and admin pause/resume.

    GET  /health          always 200 while the process serves (model, version, paused, draining,
                          running / waiting sequences, free sequence slots, KV-cache pages used / total,
                          and `processes`: this API process and the engine core -- pid, alive, why not)
    GET  /ready           200 when the engine runs and admits requests, else 503
    GET  /metrics         Prometheus text format: this API process's families, the engine core's and the
                          other API processes' (server.core.families)
    POST /admin/pause     {"abort_inflight": false}  (bearer token)  -> EngineStatus
    POST /admin/resume                                (bearer token)  -> EngineStatus
    GET  /admin/status                                (bearer token)  -> EngineStatus
    POST /admin/model_name {"name": "SDAR-1.7B-rl"}   (bearer token)  -> HealthResponse
                          the name /health, /v1/models and responses report (a trainer that took
                          the server over with train.take_over_servers=true renames it)
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from rollout_client.protocol.service import EngineStatus, HealthResponse, PauseRequest
from server.api.auth import require_admin
from server.api.errors import error_response
from server.api.openapi import error_responses
from server.api.state import ServerState, server_state
from server.core.client import CoreClient as Engine
from server.core.families import merge, render, to_wire
from server.metrics import CONTENT_TYPE, kv_pages

log = logging.getLogger("dlrl.server")
router = APIRouter(tags=["service"])
admin = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


def _health(engine: Engine, is_draining: bool = False) -> HealthResponse:
    status = "ok" if engine.is_running else "stopped"
    used, total = kv_pages(engine) or (None, None)
    return HealthResponse(status=status, model=engine.model_name, version=engine.version,
                            is_paused=engine.is_paused, is_draining=is_draining, num_running=engine.num_running,
                            num_waiting=engine.num_waiting, num_free_slots=engine.scheduler.num_free_slots,
                            num_kv_pages_used=used, num_kv_pages_total=total, processes=engine.processes())


def _status(engine: Engine) -> EngineStatus:
    return EngineStatus(is_paused=engine.is_paused, version=engine.version,
                          num_running=engine.num_running, num_waiting=engine.num_waiting)


@router.get("/health", response_model=HealthResponse)
async def health(request: Request) -> HealthResponse:
    st = server_state(request.app)
    return _health(st.engine, st.is_draining)


@router.get("/ready", response_model=HealthResponse, responses=error_responses(503))
async def ready(request: Request) -> HealthResponse | Response:
    st = server_state(request.app)
    engine = st.engine
    if st.is_draining:
        return error_response(503, "not ready: shutting down")
    if not engine.is_running or engine.model is None:
        return error_response(503, "not ready: model not loaded or engine stopped")
    if engine.is_paused:
        return error_response(503, "not ready: engine paused (weight update in progress?)")
    return _health(engine)


@router.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text exposition format", "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    return Response(await render_metrics(server_state(request.app)), media_type=CONTENT_TYPE)


async def render_metrics(st: ServerState) -> bytes:
    """This process's families merged with the engine core's and the other API processes' (the core's
    own are left out, with a log line, when it cannot answer: the scrape still says what this one knows)."""
    own = to_wire(st.metrics.families(engine_part=False))
    try:
        others = await st.engine.core_families() if not st.engine.dead else []
    except Exception as e:  # the core died meanwhile
        log.warning("metrics: the engine core's families are missing: %s", e)
        others = []
    return render(merge([own, *others]))


@admin.post("/pause", response_model=EngineStatus)
async def pause(request: Request, body: PauseRequest | None = None) -> EngineStatus:
    engine = server_state(request.app).engine
    await engine.pause(abort_inflight=bool(body and body.abort_inflight))
    return _status(engine)


@admin.post("/resume", response_model=EngineStatus)
async def resume(request: Request) -> EngineStatus:
    engine = server_state(request.app).engine
    await engine.resume()
    return _status(engine)


class ModelNameRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256, pattern=r"^[\w.\-/:@+]+$")


@admin.post("/model_name", response_model=HealthResponse)
async def model_name(body: ModelNameRequest, request: Request) -> HealthResponse:
    st = server_state(request.app)
    await st.engine.set_model_name(body.name)
    return _health(st.engine, st.is_draining)


@admin.get("/status", response_model=EngineStatus)
async def status(request: Request) -> EngineStatus:
    return _status(server_state(request.app).engine)
