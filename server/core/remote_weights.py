"""RemoteWeights: the admin weight routes' glue in an API process, forwarding to the engine core's WeightUpdates.

    updates = RemoteWeights(client)                       # server.api.app: ServerState.weight_updates
    await updates.begin(BeginRequest(...))                # -> the core's WeightUpdates.begin, same answer
    await updates.put_bucket(3, request.stream(), 7, crc, "run")   # the body streamed chunk by chunk

Same surface as server.weights.weight_updates.WeightUpdates (`WeightControl`), so the routes and
their answers do not change: each call is one `Weights` message whose body is the route's pydantic
request, and a failure comes back described as the core's routes would describe it (status and
message, raised as CoreCallFailed). The http data plane's bucket body is never held whole here:
`BucketOpen` first (ownership checked before a byte is read: 409 for another run), then every chunk
as it arrives from the HTTP server, as a raw frame after a `BucketData` header (no copy here; the
core copies it once into its staging buffer), the channel's high-water mark pushing back on the
HTTP client when the core is slower; `BucketEnd` verifies it (or releases the bucket when the body
failed half-way). The lease is renewed by the core as the bytes land.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel

from server.core import messages as m
from server.core.client import CoreClient
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

R = TypeVar("R", bound=BaseModel)


class RemoteWeights:
    def __init__(self, client: CoreClient):
        self.client = client

    async def _weights(self, op: str, answer: type[R], body: BaseModel | int | None = None) -> R:
        data = body.model_dump_json().encode() if isinstance(body, BaseModel) else m.encode_json(body or {})
        cid = self.client.next_id()
        reply = await self.client.call(m.Weights(cid, op, data), cid)
        return answer.model_validate_json(m.value(reply, bytes))  # the core's answer, as its model dumped it

    async def connect(self, body: ConnectRequest) -> ConnectResponse:
        return await self._weights("connect", ConnectResponse, body)

    async def begin(self, body: BeginRequest) -> BeginResponse:
        return await self._weights("begin", BeginResponse, body)

    async def commit(self, version: int, checksums: list[int | None] | None = None,
                     abort_inflight: bool | None = None, run_id: str = "") -> CommitResponse:
        return await self._weights("commit", CommitResponse, CommitRequest(
            version=version, checksums=checksums, abort_inflight=abort_inflight, run_id=run_id))

    async def abort(self, version: int | None = None, reason: str = "aborted by the sender",
                    run_id: str | None = "") -> AbortResponse:
        return await self._weights("abort", AbortResponse, AbortRequest(version=version, reason=reason,
                                                                        run_id=run_id or ""))

    async def status(self) -> VersionResponse:
        return await self._weights("status", VersionResponse)

    async def state(self, version: int) -> UpdateState:
        return await self._weights("state", UpdateState, version)

    async def checksum(self) -> ChecksumResponse:
        return await self._weights("checksum", ChecksumResponse)

    async def rollback(self, version: int, abort_inflight: bool | None = None) -> RollbackResponse:
        return await self._weights("rollback", RollbackResponse, RollbackRequest(version=version,
                                                                                 abort_inflight=abort_inflight))

    async def kept_status(self) -> KeptResponse:
        return await self._weights("kept", KeptResponse)

    async def put_bucket(self, index: int, stream: AsyncIterator[bytes], version: int | None, checksum: int | None,
                         run_id: str = "") -> BucketResponse:
        c = self.client
        sid = c.next_id()
        cid = c.next_id()
        await c.call(m.BucketOpen(cid, sid, index, version, checksum, run_id), cid)  # 409 before a byte is read
        ok = False
        try:
            async for chunk in stream:
                if chunk:
                    await c.send(m.BucketData(sid), chunk)
            ok = True
        finally:
            if not ok and not c.dead:  # the body failed half-way: the core releases the bucket
                end = c.next_id()
                c.call_soon(m.BucketEnd(end, sid, False), end)
        end = c.next_id()
        return BucketResponse.model_validate_json(m.value(await c.call(m.BucketEnd(end, sid, True), end), bytes))

    def close(self) -> None:
        """Nothing here: the receiver is the core's, closed with it."""


__all__ = ["RemoteWeights"]
