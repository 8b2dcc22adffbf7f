"""Service and admin schemas: health, engine pause/status, and the error body of every endpoint.

    HealthResponse(status="ok", model="tiny", version=3, is_paused=False)   # GET /health
    PauseRequest(abort_inflight=True)                                     # POST /pause (admin)
    ErrorResponse(error=ErrorBody(message="n: ...", param="n", code=400))

Errors are `ErrorResponse` bodies: `{"error": {"message", "type", "param", "code"}}` where
`param` names the offending field.
"""

from __future__ import annotations

from pydantic import BaseModel

from rollout_client.protocol.common import StrictRequest


class ProcessHealth(BaseModel):
    """One process of a server: the API process that answered, or the engine core (server.core)."""

    role: str                  # "api" or "engine_core"
    pid: int
    index: int | None = None   # an API process's index (server.api_processes)
    alive: bool = True
    mode: str | None = None    # the engine core's: "process" (its own) or "thread" (of the API process)
    reason: str | None = None  # why it is not alive


class HealthResponse(BaseModel):
    status: str
    model: str
    version: int
    is_paused: bool
    is_draining: bool = False
    num_running: int = 0
    num_waiting: int = 0
    num_free_slots: int | None = None  # free sequence slots (max_batch less running), kept for compatibility
    num_kv_pages_used: int | None = None   # KV-cache pages in use (pages of block_size tokens)
    num_kv_pages_total: int | None = None  # KV-cache pages in all (None: the backend has no paged cache)
    processes: list[ProcessHealth] | None = None  # the API process that answered and the engine core


class PauseRequest(StrictRequest):
    abort_inflight: bool | None = False


class EngineStatus(BaseModel):
    is_paused: bool
    version: int
    num_running: int
    num_waiting: int


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody
