"""Admin routes of the weight-sync control plane (bearer token: server.auth.require_admin).

    POST /weights/begin        {version, transport, manifest, options, timeout_s}  -> {num_buckets, ...}
    PUT  /weights/bucket/{i}   raw bucket bytes (http transport), headers X-Weights-Version,
                               X-Bucket-Checksum (crc32)                            -> {index, nbytes}
    POST /weights/commit       {version, checksums, abort_inflight?}                 -> {version}
    POST /weights/abort        {version?, reason?}                                   -> {aborted, version}
    GET  /weights/version      -> {version, update: {...} | null, last_failure, is_paused}
    GET  /weights/checksum     -> {version, digest}   (= weight_sync.weights_digest of the model)

Errors are 4xx JSON naming the problem: 409 stale version / update already running / no
update, 400 bad manifest or data (truncated bucket, checksum mismatch), 422 (or the app's
400 mapping) for a malformed body. The WeightUpdates glue lives in
`app.state.weight_updates`, created on first use from `app.state.engine` / `.config`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, Field

from server.auth import require_admin
from server.weight_updates import WeightUpdates, make_updates
from weight_sync.errors import WeightSyncError
from weight_sync.transports.http import CHECKSUM_HEADER, VERSION_HEADER, parse_int_header

log = logging.getLogger("dlrl.server")
router = APIRouter(prefix="/weights", tags=["weights"], dependencies=[Depends(require_admin)])


class BeginRequest(BaseModel):
    version: int = Field(ge=1)
    transport: Literal["shm", "dist", "http"]
    manifest: dict[str, Any]
    options: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0, le=86400)


class CommitRequest(BaseModel):
    version: int = Field(ge=1)
    checksums: list[int | None] | None = None
    abort_inflight: bool | None = None


class AbortRequest(BaseModel):
    version: int | None = None
    reason: str = Field(default="aborted by the sender", max_length=1000)


def get_updates(request: Request) -> WeightUpdates:
    state = request.app.state
    updates = getattr(state, "weight_updates", None)
    if updates is None:
        updates = state.weight_updates = make_updates(state.engine, getattr(state, "config", None))
    return updates


async def _call(step: str, coro: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Await a glue call, turning every failure into a 4xx with a message naming the problem."""
    try:
        return await coro
    except HTTPException:
        raise
    except WeightSyncError as e:
        raise HTTPException(status_code=e.http_status, detail=f"{step}: {e}") from None
    except TimeoutError as e:
        raise HTTPException(status_code=409, detail=f"{step}: {e or 'timed out'}") from None
    except ValueError as e:  # e.g. dllm.weights.WeightLoadError
        raise HTTPException(status_code=400, detail=f"{step}: {e}") from None
    except Exception as e:
        log.exception("weight update %s failed", step)
        raise HTTPException(status_code=400, detail=f"{step}: failed: {type(e).__name__}: {e}") from None


@router.post("/begin")
async def begin(body: BeginRequest, request: Request) -> dict[str, Any]:
    updates = get_updates(request)
    return await _call("begin", updates.begin(body.version, body.transport, body.manifest, body.options,
                                              body.timeout_s))


@router.put("/bucket/{index}")
async def put_bucket(index: int, request: Request) -> dict[str, Any]:
    updates = get_updates(request)

    async def run() -> dict[str, Any]:
        version = parse_int_header(request.headers, VERSION_HEADER)
        checksum = parse_int_header(request.headers, CHECKSUM_HEADER)
        return await updates.put_bucket(index, request.stream(), version, checksum)

    return await _call("bucket upload", run())


@router.post("/commit")
async def commit(body: CommitRequest, request: Request) -> dict[str, Any]:
    updates = get_updates(request)
    return await _call("commit", updates.commit(body.version, body.checksums, body.abort_inflight))


@router.post("/abort")
async def abort(request: Request, body: AbortRequest | None = None) -> dict[str, Any]:
    body = body or AbortRequest()
    return await _call("abort", get_updates(request).abort(body.version, body.reason))


@router.get("/version")
async def version(request: Request) -> dict[str, Any]:
    return get_updates(request).status()


@router.get("/checksum")
async def checksum(request: Request) -> dict[str, Any]:
    return await _call("checksum", get_updates(request).checksum())
