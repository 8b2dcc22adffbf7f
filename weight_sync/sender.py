"""Trainer side of a weight update: begin -> data plane -> commit on every server, or abort all.

    timings = push(["http://127.0.0.1:8000"], model.named_parameters(), version=3,
                   transport="shm", token="secret")     # {"total_s": ..., "gbps": ...}
    sender = WeightSender(servers, transport="dist", dist_addr="10.0.0.5")  # explicit owner
    sender.push(iter_deepspeed_params(engine), version=4); sender.close()

Control plane (admin HTTP, bearer token): `POST /weights/begin {version, transport,
manifest, options, timeout_s}`, then the data plane, then `POST /weights/commit {version,
checksums}`. Any failure POSTs `/weights/abort` to every server that began and raises
`WeightSyncError` naming the server and the step. Data planes (weight_sync/transports):
shm writes every bucket once into a region all same-host servers read; dist broadcasts
buckets from rank 0 (double-buffered); http PUTs each bucket to each server.
`push()` caches one WeightSender per (servers, transport, ...), so the shm region and the
dist group stay open across updates; `close_all()` (also at exit) releases them.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from weight_sync.bucket import DEFAULT_BUCKET_BYTES, pack_stream, plan_buckets
from weight_sync.errors import WeightSyncError
from weight_sync.manifest import DTYPES, Manifest, crc32
from weight_sync.sources import as_source, drain, iter_deepspeed_params
from weight_sync.transports import TRANSPORTS
from weight_sync.transports.dist import DistSender
from weight_sync.transports.http import put_bucket
from weight_sync.transports.shm import ShmRegion

__all__ = ["WeightSender", "push", "close_all", "iter_deepspeed_params", "drain", "WeightSyncError"]


class _Conflict(WeightSyncError):
    """A 409 from a server (used to rebuild a stale dist group)."""


class ControlClient:
    """Admin HTTP calls to one server (httpx, keep-alive)."""

    def __init__(self, url: str, token: str | None, timeout: float):
        import httpx  # lazy: only senders need it

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)))

    def check(self, resp: Any, step: str) -> dict[str, Any]:
        if resp.status_code < 300:
            return resp.json() if resp.content else {}
        try:
            data = resp.json()
            detail = data.get("detail") or (data.get("error") or {}).get("message") or resp.text
        except (ValueError, AttributeError):
            detail = resp.text
        cls = _Conflict if resp.status_code == 409 else WeightSyncError
        raise cls(f"{self.url}: {step} failed with HTTP {resp.status_code}: {detail}")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.check(self.http.post(f"{self.url}{path}", json=body), f"POST {path}")

    def get(self, path: str) -> dict[str, Any]:
        return self.check(self.http.get(f"{self.url}{path}"), f"GET {path}")

    def close(self) -> None:
        self.http.close()


class WeightSender:
    def __init__(
        self, servers: list[str], *, transport: str = "shm", token: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | str | None = None, timeout: float = 300.0,
        dist_addr: str = "127.0.0.1", dist_port: int = 0,
    ):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
        if not servers:
            raise ValueError("servers: need at least one server URL")
        if isinstance(dtype, str) and dtype != "auto":
            if dtype not in DTYPES:
                raise ValueError(f"dtype: expected 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        self.transport, self.bucket_bytes, self.dtype, self.timeout = transport, bucket_bytes, dtype, timeout
        self.clients = [ControlClient(u, token, timeout) for u in servers]
        self.shm = ShmRegion() if transport == "shm" else None
        self.dist = DistSender(dist_addr, dist_port, timeout) if transport == "dist" else None
        self._buffers: list[torch.Tensor] = []  # reused bucket buffers (dist, http)

    def push(self, named_tensors: Iterable | Callable, version: int) -> dict[str, Any]:
        """Send one update to every server; returns timings. Raises WeightSyncError."""
        t0 = time.perf_counter()
        if self.dtype == "auto":  # cast floating tensors to what the (first) server serves
            served = self.clients[0].get("/weights/version").get("dtype")
            self.dtype = DTYPES[served] if served else None
        source = as_source(named_tensors, self.dtype)
        manifest = plan_buckets(source.specs, self.bucket_bytes, version)
        for attempt in range(2):
            begun: list[ControlClient] = []
            try:
                self._begin_all(manifest, source.device, begun)
                t1 = time.perf_counter()
                checksums = self._send(manifest, source.make_iter(), source.device)
                t2 = time.perf_counter()
                commit = {"version": version, "checksums": checksums}
                self._parallel(lambda c, body=commit: c.post("/weights/commit", body))
                break
            except BaseException as e:
                self._abort(begun, f"sender failed: {e}")
                if self.dist is not None:
                    self.dist.close()  # the next update builds a fresh group
                if isinstance(e, _Conflict) and "group_id" in str(e) and attempt == 0:
                    continue  # a server lost the cached dist group: rebuild it once
                if isinstance(e, WeightSyncError) or not isinstance(e, Exception):
                    raise  # (KeyboardInterrupt & co. propagate as they are, after the aborts)
                raise WeightSyncError(f"push of version {version} ({self.transport}) failed: {e!r}") from e
        t3 = time.perf_counter()
        return {
            "transport": self.transport, "version": version, "num_servers": len(self.clients),
            "num_buckets": len(manifest.buckets), "bytes": manifest.total_bytes,
            "begin_s": t1 - t0, "data_s": t2 - t1, "commit_s": t3 - t2, "total_s": t3 - t0,
            "gbps": manifest.total_bytes / max(t3 - t0, 1e-9) / 1e9,
        }

    def _parallel(self, fn: Callable[[ControlClient], Any]) -> list[Any]:
        if len(self.clients) == 1:
            return [fn(self.clients[0])]
        with ThreadPoolExecutor(len(self.clients)) as pool:
            return list(pool.map(fn, self.clients))

    def _begin_all(self, manifest: Manifest, device: torch.device, begun: list[ControlClient]) -> None:
        n = len(self.clients)
        if self.shm is not None:
            options = [self.shm.prepare(manifest)] * n
        elif self.dist is not None:
            options = self.dist.prepare(n, "nccl" if device.type == "cuda" else "gloo")
        else:
            options = [{}] * n
        body = {"version": manifest.version, "transport": self.transport, "manifest": manifest.to_dict(),
                "timeout_s": self.timeout}
        for client, opts in zip(self.clients, options):
            client.post("/weights/begin", {**body, "options": opts})
            begun.append(client)

    def _buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        buf = self._buffers[slot]
        if buf.numel() < nbytes or buf.device != device:
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def _send(self, manifest: Manifest, named: Any, device: torch.device) -> list[int]:
        """Run the data plane; returns the crc32 of every bucket."""
        if self.shm is not None:  # checksum bucket i (in a thread) while packing bucket i+1
            with ThreadPoolExecutor(2) as pool:
                futures = [pool.submit(crc32, buf) for _, buf in pack_stream(manifest, named, self.shm.bucket)]
                return [f.result() for f in futures]
        if self.dist is not None:
            return self._send_dist(manifest, named, device)
        checksums = []
        for index, buf in pack_stream(manifest, named, lambda i, n: self._buffer(0, n, torch.device("cpu"))):
            crc = crc32(buf)
            checksums.append(crc)
            self._parallel(lambda c, i=index, b=buf, k=crc: c.check(
                put_bucket(c.http, c.url, i, b, k, manifest.version), f"PUT /weights/bucket/{i}"))
        return checksums

    def _send_dist(self, manifest: Manifest, named: Any, device: torch.device) -> list[int]:
        assert self.dist is not None
        self.dist.connect()  # blocks until every server joined (first update only)
        # double buffering: bucket i is on the wire (and checksummed in a thread) while i+1 is packed
        pending: list[tuple[Any, Future] | None] = [None, None]
        checksums: list[Future] = []

        def get_buffer(index: int, nbytes: int) -> torch.Tensor:
            if pending[index % 2] is not None:
                work, crc = pending[index % 2]
                work.wait()
                crc.result()
            return self._buffer(index % 2, nbytes, device)

        with ThreadPoolExecutor(1) as pool:
            for index, buf in pack_stream(manifest, named, get_buffer):
                work = self.dist.broadcast(buf)
                crc = pool.submit(crc32, buf if buf.device.type == "cpu" else buf.cpu())
                pending[index % 2] = (work, crc)
                checksums.append(crc)
            for slot in pending:
                if slot is not None:
                    slot[0].wait()
            return [f.result() for f in checksums]

    def _abort(self, begun: list[ControlClient], reason: str) -> None:
        for client in begun:
            try:
                client.post("/weights/abort", {"reason": reason[:500]})
            except Exception:  # noqa: BLE001 - best effort; the server also times out
                pass

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        if self.dist is not None:
            self.dist.close()
        for c in self.clients:
            c.close()
        self._buffers = []


_SENDERS: dict[tuple, WeightSender] = {}


def push(
    servers: list[str] | str, named_tensors: Iterable | Callable, version: int, *, transport: str = "shm",
    token: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | str | None = None,
    timeout: float = 300.0, dist_addr: str = "127.0.0.1",
) -> dict[str, Any]:
    """Push `named_tensors` as `version` to every server (cached sender; see module doc).

    dtype: cast floating tensors to it before sending (None: as they are; "auto": the
    dtype the first server serves, from GET /weights/version).
    """
    servers = [servers] if isinstance(servers, str) else list(servers)
    key = (tuple(servers), transport, token, bucket_bytes, dtype, timeout, dist_addr)
    sender = _SENDERS.get(key)
    if sender is None:
        sender = _SENDERS[key] = WeightSender(
            servers, transport=transport, token=token, bucket_bytes=bucket_bytes, dtype=dtype,
            timeout=timeout, dist_addr=dist_addr,
        )
    return sender.push(named_tensors, version)


@atexit.register
def close_all() -> None:
    """Release every cached sender (unlinks shm regions, shuts dist groups)."""
    while _SENDERS:
        _SENDERS.popitem()[1].close()
