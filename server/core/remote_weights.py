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
from weight_sync import protocol as wp

R = TypeVar("R", bound=BaseModel)


class RemoteWeights:
    def __init__(self, client: CoreClient):
        self.client = client

    async def _weights(self, op: str, answer: type[R], body: BaseModel | int | None = None) -> R:
        data = body.model_dump_json().encode() if isinstance(body, BaseModel) else m.encode_json(body or {})
        cid = self.client.next_id()
        reply = await self.client.call(m.Weights(cid, op, data), cid)
        return answer.model_validate_json(m.value(reply, bytes))  # the core's answer, as its model dumped it

    async def connect(self, body: wp.ConnectRequest) -> wp.ConnectResponse:
        return await self._weights("connect", wp.ConnectResponse, body)

    async def begin(self, body: wp.BeginRequest) -> wp.BeginResponse:
        return await self._weights("begin", wp.BeginResponse, body)

    async def commit(self, version: int, checksums: list[int | None] | None = None,
                     abort_inflight: bool | None = None, run_id: str = "") -> wp.CommitResponse:
        return await self._weights("commit", wp.CommitResponse, wp.CommitRequest(
            version=version, checksums=checksums, abort_inflight=abort_inflight, run_id=run_id))

    async def abort(self, version: int | None = None, reason: str = "aborted by the sender",
                    run_id: str | None = "") -> wp.AbortResponse:
        body = wp.AbortRequest(version=version, reason=reason, run_id=run_id or "")
        return await self._weights("abort", wp.AbortResponse, body)

    async def status(self) -> wp.VersionResponse:
        return await self._weights("status", wp.VersionResponse)

    async def state(self, version: int) -> wp.UpdateState:
        return await self._weights("state", wp.UpdateState, version)

    async def checksum(self) -> wp.ChecksumResponse:
        return await self._weights("checksum", wp.ChecksumResponse)

    async def rollback(self, version: int, abort_inflight: bool | None = None) -> wp.RollbackResponse:
        body = wp.RollbackRequest(version=version, abort_inflight=abort_inflight)
        return await self._weights("rollback", wp.RollbackResponse, body)

    async def kept_status(self) -> wp.KeptResponse:
        return await self._weights("kept", wp.KeptResponse)

    async def put_bucket(self, index: int, stream: AsyncIterator[bytes], version: int | None, checksum: int | None,
                         run_id: str = "") -> wp.BucketResponse:
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
        return wp.BucketResponse.model_validate_json(m.value(await c.call(m.BucketEnd(end, sid, True), end), bytes))

    def close(self) -> None:
        """Nothing here: the receiver is the core's, closed with it."""


__all__ = ["RemoteWeights"]
