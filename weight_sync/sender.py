"""Trainer side of a weight update: connect once, then begin -> data plane -> commit, or abort all.

    with WeightSender(servers, transport="dist", dist_addr="10.0.0.5", run_id="job-7") as sender:
        sender.connect(src)                     # at startup: the one-time setup
        timings = sender.push(iter_deepspeed_params(engine), version=4)   # {"total_s": ..., "gbps": ...}
    push(servers, model.hf_named_tensors(), version=5, transport="http", token=tok)  # one push; WeightSyncError

Connect (`POST /weights/connect`) does the one-time work: the shm region is created and its
pages populated, the dist group built (the trainer hosts its store on `dist_addr`), and
every server sizes its private staging; it runs again only when the layout grows or
changes. A push then: `POST /weights/begin` (bodies: weight_sync/protocol.py), the data
plane -- tensors are packed straight from the source into the shm region / a send buffer,
hashed (xxh3) chunk by chunk while packing; dist and http pack bucket k+1 while bucket k
is on the wire -- then `POST /weights/commit` with the checksums, which succeeds exactly
when the server applied the version (weight_sync/control.py). Every failure, from the
first begin on and including KeyboardInterrupt, aborts the update on every server that
may have begun it. `run_id` names the pushing run and goes with every call (connect, begin,
each http bucket, commit, abort): the server refuses a call about an update another run
began (409 naming the owner). A resumed run (same id) takes over its own stale update at
once; another run waits for that update's lease to lapse.
`dtype` casts floating tensors before sending ("auto": what the server serves, e.g. bf16,
which halves the bytes; checksums cover what is sent).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from weight_sync.bucket import DEFAULT_BUCKET_BYTES, pack_stream, plan_buckets
from weight_sync.control import ControlClient, HTTPStatusError
from weight_sync.errors import WeightSyncError
from weight_sync.manifest import DTYPES, Manifest
from weight_sync.protocol import AbortRequest, BeginRequest, CommitRequest, ConnectRequest
from weight_sync.sources import Source, as_source, drain, iter_deepspeed_params
from weight_sync.transports import TRANSPORTS
from weight_sync.transports.dist import DistSender
from weight_sync.transports.http import put_bucket
from weight_sync.transports.shm import ShmRegion

__all__ = ["WeightSender", "push", "iter_deepspeed_params", "drain", "WeightSyncError"]


def default_run_id() -> str:
    return f"{socket.gethostname()[:32]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WeightSender:
    def __init__(
        self, servers: list[str], *, transport: str = "shm", token: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | str | None = None, timeout: float = 300.0,
        dist_addr: str = "127.0.0.1", dist_port: int = 0, run_id: str | None = None, lease_s: float | None = None,
        abort_inflight: bool | None = None,
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
        self.run_id, self.lease_s, self.abort_inflight = run_id or default_run_id(), lease_s, abort_inflight
        self.clients = [ControlClient(u, token, timeout) for u in servers]
        self.shm = ShmRegion(self.run_id) if transport == "shm" else None
        self.dist = DistSender(dist_addr, dist_port, min(timeout, 60.0)) if transport == "dist" else None
        self._buffers: list[torch.Tensor] = []  # reused double buffers (dist, http)
        self._layout: tuple | None = None  # (bucket sizes, device) the servers are connected for
        self._options: list[dict[str, Any]] = [{}] * len(self.clients)

    # ------------------------------------------------------------------ connect
    def _source(self, named_tensors: Iterable | Callable) -> Source:
        if self.dtype == "auto":  # cast floating tensors to what the (first) server serves
            served = self.clients[0].status().dtype
            self.dtype = DTYPES[served] if served else None
        assert not isinstance(self.dtype, str), "dtype: 'auto' is resolved above, other names in __init__"
        return as_source(named_tensors, self.dtype)

    def connect(self, named_tensors: Iterable | Callable) -> dict[str, Any]:
        """One-time setup for tensors shaped like `named_tensors`: region, group, server staging."""
        t0 = time.perf_counter()
        source = self._source(named_tensors)
        self._connect(plan_buckets(source.specs, self.bucket_bytes, 0), source.device)
        return {"connect_s": time.perf_counter() - t0}

    def _connect(self, manifest: Manifest, device: torch.device) -> None:
        self._layout = None
        n = len(self.clients)
        fresh = True
        if self.shm is not None:
            self._options = [self.shm.prepare(manifest)] * n
        elif self.dist is not None:
            self._options, fresh = self.dist.prepare(n, "nccl" if device.type == "cuda" else "gloo")
        if fresh:
            body = [ConnectRequest(transport=self.transport, manifest=manifest.to_dict(), options=o,
                                   run_id=self.run_id) for o in self._options]
            self._parallel(lambda c, i: c.connect(body[i]))
        if self.dist is not None:
            self.dist.connect(device)  # blocks until every server joined
        if self.shm is None:  # the two send buffers, their pages touched now rather than in the first push
            biggest = max(b.nbytes for b in manifest.buckets)
            for slot in range(2):
                self._buffer(slot, biggest, device if self.dist is not None else torch.device("cpu")).fill_(0)
        self._layout = (tuple(b.nbytes for b in manifest.buckets), device)

    # ------------------------------------------------------------------ push
    def push(self, named_tensors: Iterable | Callable, version: int) -> dict[str, Any]:
        """Send one update to every server; returns timings. Raises WeightSyncError."""
        t0 = time.perf_counter()
        source = self._source(named_tensors)
        manifest = plan_buckets(source.specs, self.bucket_bytes, version)
        connect_s = 0.0
        for attempt in range(2):
            begun: list[ControlClient] = []
            try:
                if self._layout != (tuple(b.nbytes for b in manifest.buckets), source.device):
                    tc = time.perf_counter()
                    self._connect(manifest, source.device)
                    connect_s += time.perf_counter() - tc
                t1 = time.perf_counter()
                if self.shm is not None:
                    self.shm.clear_ready()  # before begin: the server stages buckets once marked ready
                self._begin_all(manifest, begun)
                t2 = time.perf_counter()
                checksums = self._send(manifest, source.make_iter(), source.device)
                t3 = time.perf_counter()
                body = CommitRequest(version=version, checksums=checksums, abort_inflight=self.abort_inflight,
                                     run_id=self.run_id)
                self._commit_all(body)
                break
            except BaseException as e:
                self._abort(begun, version, f"sender failed: {e}")
                if self.dist is not None:
                    self.dist.close()  # the collective sequence is broken: the next push reconnects
                    self._layout = None
                if isinstance(e, HTTPStatusError) and e.status == 409 and "group_id" in str(e) and attempt == 0:
                    continue  # a server lost the dist group (restarted?): connect again, once
                if isinstance(e, WeightSyncError) or not isinstance(e, Exception):
                    raise  # (KeyboardInterrupt & co. propagate as they are, after the aborts)
                raise WeightSyncError(f"push of version {version} ({self.transport}) failed: {e!r}") from e
        t4 = time.perf_counter()
        return {
            "transport": self.transport, "version": version, "num_servers": len(self.clients),
            "num_buckets": len(manifest.buckets), "bytes": manifest.total_bytes, "connect_s": connect_s,
            "begin_s": t2 - t1, "data_s": t3 - t2, "commit_s": t4 - t3, "total_s": t4 - t0,
            "gbps": manifest.total_bytes / max(t4 - t0, 1e-9) / 1e9,
        }

    def _parallel(self, fn: Callable[[ControlClient, int], Any]) -> list[Any]:
        if len(self.clients) == 1:
            return [fn(self.clients[0], 0)]
        with ThreadPoolExecutor(len(self.clients)) as pool:
            return list(pool.map(fn, self.clients, range(len(self.clients))))

    def _commit_all(self, body: CommitRequest) -> None:
        self._parallel(lambda c, _i: c.commit(body))

    def _begin_all(self, manifest: Manifest, begun: list[ControlClient]) -> None:
        for client, opts in zip(self.clients, self._options):
            begun.append(client)  # before the call: a begin that timed out may still have begun
            client.begin(BeginRequest(version=manifest.version, transport=self.transport,
                                      manifest=manifest.to_dict(), options=opts, run_id=self.run_id,
                                      lease_s=self.lease_s))

    def _buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        buf = self._buffers[slot]
        if buf.numel() < nbytes or buf.device != device:
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def _send(self, manifest: Manifest, named: Any, device: torch.device) -> list[int]:
        """Run the data plane; returns the checksum of every bucket (computed while packing)."""
        if self.shm is not None:
            checksums = []
            for index, _, crc in pack_stream(manifest, named, self.shm.bucket, self.shm.beat):
                self.shm.mark_ready(index, manifest.version)  # the server copies it while we pack the next
                checksums.append(crc)
            return checksums
        if (dist := self.dist) is not None:
            return self._pipelined(manifest, named, device, lambda i, buf, crc: dist.broadcast(buf))
        with ThreadPoolExecutor(1, thread_name_prefix="weight-sync-put") as pool:
            def put(i: int, buf: torch.Tensor, crc: int) -> Future:
                return pool.submit(self._parallel, lambda c, _k: c.check(
                    put_bucket(c.http, c.url, i, buf, crc, manifest.version, run_id=self.run_id),
                    f"PUT /weights/bucket/{i}"))
            return self._pipelined(manifest, named, torch.device("cpu"), put)

    def _pipelined(self, manifest: Manifest, named: Any, device: torch.device,
                   start: Callable[[int, torch.Tensor, int], Any]) -> list[int]:
        """Double buffering: bucket k is on the wire while bucket k+1 is packed into the other buffer."""
        inflight: list[Any] = [None, None]

        def finish(work: Any) -> None:
            if work is not None:
                work.result() if isinstance(work, Future) else work.wait()

        def get_buffer(index: int, nbytes: int) -> torch.Tensor:
            finish(inflight[index % 2])
            inflight[index % 2] = None
            return self._buffer(index % 2, nbytes, device)

        checksums = []
        try:
            for index, buf, crc in pack_stream(manifest, named, get_buffer):
                checksums.append(crc)
                inflight[index % 2] = start(index, buf, crc)
            for work in inflight:
                finish(work)
        finally:
            for work in inflight:
                if isinstance(work, Future):
                    work.cancel()
        return checksums

    def _abort(self, begun: list[ControlClient], version: int, reason: str) -> None:
        for client in begun:
            try:
                client.abort(AbortRequest(version=version, reason=reason[:1000], run_id=self.run_id))
            except Exception:  # noqa: BLE001 - best effort; the server's lease ends it anyway
                pass

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        if self.dist is not None:
            self.dist.close()
        for c in self.clients:
            c.close()
        self._buffers, self._layout = [], None


def push(
    servers: list[str] | str, named_tensors: Iterable | Callable, version: int, *, transport: str = "shm",
    token: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | str | None = None,
    timeout: float = 300.0, dist_addr: str = "127.0.0.1", run_id: str | None = None, lease_s: float | None = None,
    abort_inflight: bool | None = None,
) -> dict[str, Any]:
    """Push `named_tensors` as `version` to every server once: a sender for this push, closed after.

    A run that pushes again keeps one `WeightSender` open instead (trainer/infra/fleet.py): its
    connect (shm region, dist group, the servers' staging) is then done once.
    dtype: cast floating tensors to it before sending (None: as they are; "auto": the
    dtype the first server serves, from GET /weights/version). run_id: names the pushing run
    (default: host-pid-random; pass the run's name so a resumed run takes over its own update).
    """
    with WeightSender([servers] if isinstance(servers, str) else list(servers), transport=transport, token=token,
                      bucket_bytes=bucket_bytes, dtype=dtype, timeout=timeout, dist_addr=dist_addr, run_id=run_id,
                      lease_s=lease_s, abort_inflight=abort_inflight) as sender:
        return sender.push(named_tensors, version)
