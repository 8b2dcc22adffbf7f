"""Glue between weight_sync.WeightReceiver and the Engine: the server's update window.

    updates = make_updates(engine, config)            # one per app (routes_weights creates it)
    await updates.begin(BeginRequest(...))            # validate against engine.model, stage
    await updates.commit(7, checksums)                # verify -> drain -> apply -> version -> resume

Commit = verify the staged bytes (in a worker thread: checksums and NaN/inf), then the
drain: admission stops and in-flight sequences get `drain_timeout_s` to finish. Past that
bound, with `abort_inflight` they are aborted (finish_reason "abort") and the update is
applied; without it they finish on the old weights, the commit answers "pending" and the
update is applied in the background as soon as they are done (the sender polls
`GET /weights/updates/{v}`; an abort meanwhile cancels it). The copy into the model is
`dllm.weights.copy_into_model` (the checkpoint-loading path); then `engine.version` is set
and the engine resumes -- also on failure. An engine an admin had paused stays paused. A
failed update leaves weights and version unchanged; a retried commit of an applied
version answers "applied".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from weight_sync import UpdateFailed, WeightReceiver
from weight_sync.protocol import BeginRequest, ConnectRequest
from weight_sync.transports.http import read_body_into

log = logging.getLogger("dlrl.server")


def _default_apply(engine: Any) -> Callable[[list[tuple[str, torch.Tensor]]], Any]:
    from dllm.weights import copy_into_model  # the one function that writes parameters

    return lambda named: copy_into_model(engine.model, named, strict=True)


class WeightUpdates:
    def __init__(
        self, engine: Any, *, lease_s: float = 30.0, drain_timeout_s: float = 30.0, abort_inflight: bool = False,
        check_finite: bool = True, apply_fn: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
    ):
        self.engine = engine
        self.abort_inflight, self.drain_timeout_s = abort_inflight, drain_timeout_s
        self.receiver = WeightReceiver(
            lambda: dict(engine.model.named_parameters()), apply_fn or _default_apply(engine),
            version=int(engine.version), lease_s=lease_s, check_finite=check_finite,
        )
        self._commits: dict[int, asyncio.Task] = {}
        self._verify_s = 0.0

    @property
    def version(self) -> int:
        return int(self.engine.version)

    def status(self) -> dict[str, Any]:
        return {**self.receiver.status(), "version": self.version, "is_paused": bool(self.engine.is_paused)}

    def state(self, version: int) -> dict[str, Any]:
        return {**self.receiver.state(version), "served_version": self.version}

    def _sync_version(self) -> None:
        rx = self.receiver
        if rx.status()["update"] is None and rx.version != self.version:
            rx.version = self.version  # the engine is the source of truth for the served version

    async def connect(self, body: ConnectRequest) -> dict[str, Any]:
        return await asyncio.to_thread(self.receiver.connect, body.transport, body.manifest, body.options,
                                       body.run_id)

    async def begin(self, body: BeginRequest) -> dict[str, Any]:
        self._sync_version()
        return await asyncio.to_thread(self.receiver.begin, body.version, body.transport, body.manifest,
                                       body.options, body.lease_s, body.run_id)

    async def put_bucket(
        self, index: int, stream: AsyncIterator[bytes], version: int | None, checksum: int | None,
    ) -> dict[str, Any]:
        """http data plane: stream one request body into the staging bucket, then verify it."""
        buf = self.receiver.bucket_buffer(index, version)
        try:
            nbytes = await read_body_into(stream, buf, self.receiver.touch)
        except BaseException:
            self.receiver.bucket_written(index, None, None, version)  # releases the bucket
            raise
        await asyncio.to_thread(self.receiver.bucket_written, index, nbytes, checksum, version)
        return {"index": index, "nbytes": nbytes}

    async def commit(self, version: int, checksums: list[int | None] | None = None,
                     abort_inflight: bool | None = None) -> dict[str, Any]:
        """Verify, drain (bounded), apply. Returns {"state": "applied" | "pending", ...}."""
        abort = self.abort_inflight if abort_inflight is None else abort_inflight
        task = self._commits.get(version)
        if task is None:
            if self.receiver.committed(version):
                return {"version": version, "state": "applied", "served_version": self.version}
            t0 = time.perf_counter()
            await asyncio.to_thread(self.receiver.verify, version, checksums)
            self._verify_s = time.perf_counter() - t0
            task = self._commits[version] = asyncio.create_task(self._drain_and_apply(version, abort))
            task.add_done_callback(lambda _t: self._commits.pop(version, None))
        bound = self.drain_timeout_s * (2 if abort else 1) + 2.0
        try:
            await asyncio.wait_for(asyncio.shield(task), bound)
        except TimeoutError:
            return {"version": version, "state": "pending", "served_version": self.version}
        return {"version": version, "state": "applied", "served_version": self.version}

    async def _drain_and_apply(self, version: int, abort: bool) -> None:
        engine, rx = self.engine, self.receiver
        was_paused = bool(engine.is_paused)
        rx.set_draining(version)
        try:
            t0 = time.perf_counter()
            await self._drain(version, abort)
            t1 = time.perf_counter()
            await asyncio.to_thread(rx.apply, version)
            engine.version = rx.version
            log.info("weights updated to version %d (verify %.3fs, drain %.3fs, apply %.3fs)", rx.version,
                     self._verify_s, t1 - t0, time.perf_counter() - t1)
        except BaseException as e:
            if rx.state(version)["state"] in ("draining", "verified"):
                rx.abort(version, f"drain failed: {e!r}")
            raise
        finally:
            if not was_paused:
                await engine.resume()

    async def _drain(self, version: int, abort: bool) -> None:
        """Wait (bounded) for in-flight sequences; then abort them, or keep waiting for them."""
        try:
            await self.engine.pause(abort_inflight=False, timeout=self.drain_timeout_s)
            return
        except TimeoutError:
            pass
        if abort:
            log.warning("update %d: in-flight sequences still running after %.1fs: aborting them",
                        version, self.drain_timeout_s)
            await self.engine.pause(abort_inflight=True, timeout=self.drain_timeout_s)
            return
        log.info("update %d pending: in-flight sequences finish on the old weights first", version)
        while True:
            if self.receiver.state(version)["state"] != "draining":
                raise UpdateFailed(f"update {version} was aborted while in-flight sequences drained")
            try:
                await self.engine.pause(abort_inflight=False, timeout=1.0)
                return
            except TimeoutError:
                continue

    async def abort(self, version: int | None = None, reason: str = "aborted by the sender",
                    run_id: str | None = None) -> dict[str, Any]:
        aborted = await asyncio.to_thread(self.receiver.abort, version, reason, run_id)
        return {"aborted": aborted, "version": self.version}

    async def checksum(self) -> dict[str, Any]:
        digest = await asyncio.to_thread(self.receiver.digest)
        return {"version": self.version, "digest": digest}

    def close(self) -> None:
        self.receiver.close()


def make_updates(engine: Any, config: Any = None) -> WeightUpdates:
    """WeightUpdates configured from `config` (server.config.ServerConfig weight_sync_* keys)."""
    return WeightUpdates(
        engine,
        lease_s=float(getattr(config, "weight_sync_lease_s", 30.0)),
        drain_timeout_s=float(getattr(config, "weight_sync_drain_timeout_s", 30.0)),
        abort_inflight=bool(getattr(config, "weight_sync_abort_inflight", False)),
        check_finite=bool(getattr(config, "weight_sync_check_finite", True)),
    )


__all__ = ["WeightUpdates", "make_updates"]
