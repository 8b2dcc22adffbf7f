"""Service routes: health, readiness, Prometheus metrics, and admin pause/resume.

    GET  /health          always 200 while the process serves (model, version, paused, draining,
                          running / waiting sequences, free sequence slots, KV-cache pages used / total)
    GET  /ready           200 when the engine runs and admits requests, else 503
    GET  /metrics         Prometheus text format (per-app registry)
    POST /admin/pause     {"abort_inflight": false}  (bearer token)  -> EngineStatus
    POST /admin/resume                                (bearer token)  -> EngineStatus
    GET  /admin/status                                (bearer token)  -> EngineStatus
    POST /admin/model_name {"name": "SDAR-1.7B-rl"}   (bearer token)  -> HealthResponse
                          the name /health, /v1/models and responses report (a trainer that took
                          the server over with train.take_over_servers=true renames it)
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from rollout_client.protocol.service import EngineStatus, HealthResponse, PauseRequest
from server.api.auth import require_admin
from server.api.errors import error_response
from server.api.openapi import error_responses
from server.api.state import server_state
from server.engine.engine import Engine
from server.metrics import CONTENT_TYPE, kv_pages

router = APIRouter(tags=["service"])
admin = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


def _health(engine: Engine, is_draining: bool = False) -> HealthResponse:
    status = "ok" if engine.is_running else "stopped"
    used, total = kv_pages(engine) or (None, None)
    return HealthResponse(status=status, model=engine.model_name, version=engine.version,
                            is_paused=engine.is_paused, is_draining=is_draining, num_running=engine.num_running,
                            num_waiting=engine.num_waiting, num_free_slots=engine.scheduler.num_free_slots,
                            num_kv_pages_used=used, num_kv_pages_total=total)


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
    return Response(server_state(request.app).metrics.render(), media_type=CONTENT_TYPE)


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
    st.engine.model_name = body.name
    return _health(st.engine, st.is_draining)


@admin.get("/status", response_model=EngineStatus)
async def status(request: Request) -> EngineStatus:
    return _status(server_state(request.app).engine)
