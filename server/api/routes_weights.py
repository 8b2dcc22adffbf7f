"""Admin routes of the weight-sync control plane (bearer token: server.api.auth.require_admin).

    POST /weights/connect      ConnectRequest -> ConnectResponse  (one-time: region, staging, dist group)
    POST /weights/begin        BeginRequest   -> BeginResponse
    PUT  /weights/bucket/{i}   raw bucket bytes (http transport), headers X-Weights-Version,
                               X-Weights-Run-Id, X-Bucket-Checksum (xxh3_64) -> BucketResponse
    POST /weights/commit       CommitRequest  -> CommitResponse (200 applied, 202 pending drain)
    POST /weights/abort        AbortRequest   -> AbortResponse
    GET  /weights/version      -> VersionResponse
    GET  /weights/updates/{v}  -> UpdateState  (applied / failed / in progress / unknown)
    GET  /weights/checksum     -> ChecksumResponse (= weight_sync.weights_digest of the model)
    POST /weights/rollback     RollbackRequest -> RollbackResponse (404 not kept, 409 update in progress)
    GET  /weights/kept         -> KeptResponse (versions kept in host memory, server.keep_versions)

Bodies are the pydantic models of weight_sync.protocol, which the sender uses too. Every
call about an update names its run (`run_id` in the body, the X-Weights-Run-Id header of a
bucket; absent = the anonymous run ""): a bucket, commit or abort of an update another run
began is a 409 naming the owner, before anything is read or changed (docs/SECURITY.md).
Errors are 4xx JSON naming the problem: 409 stale version / update already running / no update,
400 bad manifest or data (truncated bucket, checksum mismatch, NaN/inf weights), 400 for a
malformed body (the app's validation mapping). The WeightUpdates glue is
`ServerState.weight_updates` (server.api.state), the one server.api.app.create_app builds.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from rollout_client.protocol.service import ErrorResponse
from server.api.auth import require_admin
from server.api.state import server_state
from server.weights.control import WeightControl, describe_error
from weight_sync.protocol import (
    AbortRequest,
    AbortResponse,
    BeginRequest,
    BeginResponse,
    BucketResponse,
    ChecksumResponse,
    CommitRequest,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    KeptResponse,
    RollbackRequest,
    RollbackResponse,
    UpdateState,
    VersionResponse,
)
from weight_sync.transports.http import CHECKSUM_HEADER, VERSION_HEADER, parse_int_header, parse_run_id_header

log = logging.getLogger("dlrl.server")
R = TypeVar("R", bound=BaseModel)
router = APIRouter(prefix="/weights", tags=["weights"], dependencies=[Depends(require_admin)])


def get_updates(request: Request) -> WeightControl:
    updates = server_state(request.app).weight_updates
    if updates is None:  # an app without create_app must attach its own (server.api.state.attach)
        raise RuntimeError("no WeightUpdates attached to this app")
    return updates


async def _call(step: str, coro: Awaitable[R]) -> R:
    """Await a glue call, turning every failure into a 4xx with a message naming the problem
    (server.weights.weight_updates.describe_error; the engine core's failures come described)."""
    try:
        return await coro
    except HTTPException:
        raise
    except Exception as e:
        status, message = describe_error(e)
        raise HTTPException(status_code=status, detail=f"{step}: {message}") from None


@router.post("/connect", response_model=ConnectResponse)
async def connect(body: ConnectRequest, request: Request) -> ConnectResponse:
    return await _call("connect", get_updates(request).connect(body))


@router.post("/begin", response_model=BeginResponse)
async def begin(body: BeginRequest, request: Request) -> BeginResponse:
    return await _call("begin", get_updates(request).begin(body))


@router.put("/bucket/{index}", response_model=BucketResponse)
async def put_bucket(index: int, request: Request) -> BucketResponse:
    updates = get_updates(request)

    async def run() -> BucketResponse:
        version = parse_int_header(request.headers, VERSION_HEADER)
        checksum = parse_int_header(request.headers, CHECKSUM_HEADER)
        run_id = parse_run_id_header(request.headers)
        return await updates.put_bucket(index, request.stream(), version, checksum, run_id)

    return await _call("bucket upload", run())


@router.post("/commit", response_model=CommitResponse, responses={202: {"model": CommitResponse}})
async def commit(body: CommitRequest, request: Request) -> CommitResponse | JSONResponse:
    result = await _call("commit", get_updates(request).commit(body.version, body.checksums, body.abort_inflight,
                                                               body.run_id))
    if result.state == "pending":
        return JSONResponse(result.model_dump(), status_code=202)
    return result


@router.post("/abort", response_model=AbortResponse)
async def abort(request: Request, body: AbortRequest | None = None) -> AbortResponse:
    body = body or AbortRequest()
    return await _call("abort", get_updates(request).abort(body.version, body.reason, body.run_id))


@router.get("/version", response_model=VersionResponse)
async def version(request: Request) -> VersionResponse:
    return await _call("version", get_updates(request).status())


@router.get("/updates/{version}", response_model=UpdateState)
async def update_state(version: int, request: Request) -> UpdateState:
    return await _call("update state", get_updates(request).state(version))


@router.get("/checksum", response_model=ChecksumResponse)
async def checksum(request: Request) -> ChecksumResponse:
    return await _call("checksum", get_updates(request).checksum())


@router.post("/rollback", response_model=RollbackResponse, responses={
    404: {"model": ErrorResponse, "description": "This version is not kept here (GET /weights/kept)"},
    409: {"model": ErrorResponse, "description": "A weight update is in progress, or in-flight sequences did "
          "not finish within weight_sync_drain_timeout_s (retry, or pass abort_inflight)"}})
async def rollback(body: RollbackRequest, request: Request) -> RollbackResponse:
    result = await _call("rollback", get_updates(request).rollback(body.version, body.abort_inflight))
    server_state(request.app).metrics.rollbacks.inc()
    return result


@router.get("/kept", response_model=KeptResponse)
async def kept(request: Request) -> KeptResponse:
    return await _call("kept", get_updates(request).kept_status())
