"""What the admin weight routes call (`WeightControl`) and how a failed call is answered (`describe_error`),
torch-free: the API processes of `dlrl serve` hold a proxy (server.core.remote_weights.RemoteWeights) and never
import torch; the in-process receiver is server.weights.weight_updates.WeightUpdates."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Protocol

from weight_sync.errors import WeightSyncError
from weight_sync.protocol import (
    AbortResponse,
    BeginRequest,
    BeginResponse,
    BucketResponse,
    ChecksumResponse,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    KeptResponse,
    RollbackResponse,
    UpdateState,
    VersionResponse,
)

log = logging.getLogger("dlrl.server")


class WeightControl(Protocol):
    """What the admin routes (server.api.routes_weights) call: WeightUpdates in this process, or its proxy
    in an API process whose engine runs in the engine core (server.core.remote_weights.RemoteWeights)."""

    async def connect(self, body: ConnectRequest) -> ConnectResponse: ...
    async def begin(self, body: BeginRequest) -> BeginResponse: ...
    async def put_bucket(self, index: int, stream: AsyncIterator[bytes], version: int | None, checksum: int | None,
                         run_id: str = "") -> BucketResponse: ...
    async def commit(self, version: int, checksums: list[int | None] | None = None,
                     abort_inflight: bool | None = None, run_id: str = "") -> CommitResponse: ...
    async def abort(self, version: int | None = None, reason: str = "aborted by the sender",
                    run_id: str | None = "") -> AbortResponse: ...
    async def status(self) -> VersionResponse: ...
    async def state(self, version: int) -> UpdateState: ...
    async def checksum(self) -> ChecksumResponse: ...
    async def rollback(self, version: int, abort_inflight: bool | None = None) -> RollbackResponse: ...
    async def kept_status(self) -> KeptResponse: ...
    def close(self) -> None: ...


def describe_error(e: BaseException) -> tuple[int, str]:
    """(HTTP status, message) of a failed weight call, as the admin routes answer it (the route prefixes
    the step): the error's own status for weight_sync errors, 409 a timeout, 400 anything else."""
    if isinstance(e, WeightSyncError):
        return e.http_status, str(e)
    if isinstance(e, TimeoutError):
        return 409, str(e) or "timed out"
    if isinstance(e, ValueError):  # e.g. dllm.weights.WeightLoadError
        return 400, str(e)
    log.error("weight update call failed: %s: %s", type(e).__name__, e, exc_info=e)
    return 400, f"failed: {type(e).__name__}: {e}"
