"""HTTP data plane (slow fallback, any network): one `PUT /weights/bucket/{index}` per bucket.

Sender:   put_bucket(client, "http://host:8000", index=2, buf=bucket, checksum=xxh, version=7)
Receiver: n = await read_body_into(request.stream(), staging_bucket, renew)   # route handler

The body is the bucket's raw bytes (`application/octet-stream`, Content-Length set);
headers carry the update version, the pushing run (X-Weights-Run-Id: only the run that
began the update may write its buckets; absent = the anonymous run "") and the bucket's
xxh3_64 so the server can reject a bad bucket at once (the commit carries the checksums
again). The body is streamed straight into the receiver's staging tensor (no pickle, no
intermediate `bytes` of the whole bucket); `renew` is called every few MiB: the data
plane keeps the update's lease alive.
The sender packs bucket k+1 while bucket k is on the wire (weight_sync/sender.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from weight_sync.errors import UpdateFailed
from weight_sync.protocol import RUN_ID_MAX_LENGTH, RUN_ID_PATTERN

if TYPE_CHECKING:  # annotations only: the API processes of `dlrl serve` parse these headers without torch
    import torch

CHUNK_BYTES = 4 << 20
VERSION_HEADER = "X-Weights-Version"
CHECKSUM_HEADER = "X-Bucket-Checksum"
RUN_ID_HEADER = "X-Weights-Run-Id"


def _chunks(buf: torch.Tensor, chunk: int = CHUNK_BYTES) -> Iterator[memoryview]:
    mv = buf.numpy().data  # ndarray.data: the memoryview of its bytes (no copy)
    # buf: [nbytes] uint8, contiguous CPU
    for start in range(0, len(mv), chunk):
        yield mv[start : start + chunk]


def put_bucket(
    client: Any, base_url: str, index: int, buf: torch.Tensor, checksum: int, version: int,
    headers: dict[str, str] | None = None, run_id: str = "",
) -> Any:
    """PUT one bucket with an httpx.Client; returns the response (caller checks status)."""
    h = {
        **(headers or {}),
        "Content-Type": "application/octet-stream",
        "Content-Length": str(buf.numel()),
        VERSION_HEADER: str(version),
        CHECKSUM_HEADER: str(checksum),
        RUN_ID_HEADER: run_id,
    }
    return client.put(f"{base_url.rstrip('/')}/weights/bucket/{index}", content=_chunks(buf), headers=h)


def parse_int_header(headers: Any, name: str) -> int | None:
    """An optional non-negative integer header; UpdateFailed if present but malformed."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise UpdateFailed(f"header {name}: expected an integer, got {value!r}") from None
    if n < 0:
        raise UpdateFailed(f"header {name}: expected a non-negative integer, got {n}")
    return n


def parse_run_id_header(headers: Any) -> str:
    """The X-Weights-Run-Id header ("" when absent); UpdateFailed (400) if it is not a run id."""
    value = headers.get(RUN_ID_HEADER) or ""
    if len(value) > RUN_ID_MAX_LENGTH or not re.fullmatch(RUN_ID_PATTERN, value):
        raise UpdateFailed(f"header {RUN_ID_HEADER}: expected at most {RUN_ID_MAX_LENGTH} characters "
                           f"matching {RUN_ID_PATTERN}, got {value[:40]!r}")
    return value


async def read_body_into(stream: AsyncIterator[bytes], dest: torch.Tensor,
                         renew: Callable[[], None] | None = None, renew_bytes: int = 16 << 20) -> int:
    """Copy a streamed body into `dest` ([nbytes] uint8); returns bytes read.

    Raises UpdateFailed if the body is longer than `dest` (the caller checks for short).
    """
    cap, pos, next_renew = dest.numel(), 0, renew_bytes
    view = dest.numpy().data  # ndarray.data: the memoryview of its bytes (no copy)
    # (the writes go straight into the staging tensor)
    async for chunk in stream:
        if renew is not None and pos >= next_renew:
            renew()
            next_renew = pos + renew_bytes
        n = len(chunk)
        if not n:
            continue
        if pos + n > cap:
            raise UpdateFailed(f"body is longer than the bucket's {cap} bytes")
        view[pos : pos + n] = chunk
        pos += n
    return pos
