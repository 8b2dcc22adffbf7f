"""Glue between weight_sync.WeightReceiver and the Engine: the server's update window.

    updates = WeightUpdates(engine)                    # one per app (routes_weights creates it)
    await updates.begin(7, "shm", manifest, options)   # validate against engine.model, stage
    await updates.commit(7, checksums)                 # verify -> pause -> apply -> version -> resume

Commit = verify the staged bytes (in a worker thread), `await engine.pause(abort_inflight)`
(admission stops; in-flight sequences finish by default, so no sequence mixes versions),
copy into the model with `dllm.weights.copy_into_model` (the checkpoint-loading path),
set `engine.version`, and `await engine.resume()` -- also on failure. An engine that an
admin had paused before the update stays paused. Any failure leaves weights and version
unchanged (copy_into_model validates everything before copying anything).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from weight_sync import WeightReceiver
from weight_sync.transports.http import read_body_into

log = logging.getLogger("dlrl.server")


def _default_apply(engine: Any) -> Callable[[list[tuple[str, torch.Tensor]]], Any]:
    from dllm.weights import copy_into_model  # the one function that writes parameters

    return lambda named: copy_into_model(engine.model, named, strict=True)


class WeightUpdates:
    def __init__(
        self, engine: Any, *, timeout_s: float = 300.0, abort_inflight: bool = False,
        apply_fn: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
    ):
        self.engine = engine
        self.abort_inflight = abort_inflight
        self.receiver = WeightReceiver(
            lambda: dict(engine.model.named_parameters()),
            apply_fn or _default_apply(engine),
            version=int(engine.version),
            timeout_s=timeout_s,
        )

    @property
    def version(self) -> int:
        return int(self.engine.version)

    def status(self) -> dict[str, Any]:
        return {**self.receiver.status(), "version": self.version, "is_paused": bool(self.engine.is_paused)}

    async def begin(
        self, version: int, transport: str, manifest: dict[str, Any],
        options: dict[str, Any] | None = None, timeout_s: float | None = None,
    ) -> dict[str, Any]:
        rx = self.receiver
        if rx.status()["update"] is None and rx.version != self.version:
            rx.version = self.version  # the engine is the source of truth for the served version
        return await asyncio.to_thread(rx.begin, version, transport, manifest, options, timeout_s)

    async def put_bucket(
        self, index: int, stream: AsyncIterator[bytes], version: int | None, checksum: int | None,
    ) -> dict[str, Any]:
        """http data plane: stream one request body into the staging bucket, then verify it."""
        buf = self.receiver.bucket_buffer(index, version)
        try:
            nbytes = await read_body_into(stream, buf)
        except BaseException:
            self.receiver.bucket_written(index, None, None, version)  # releases the bucket
            raise
        await asyncio.to_thread(self.receiver.bucket_written, index, nbytes, checksum, version)
        return {"index": index, "nbytes": nbytes}

    async def commit(self, version: int, checksums: list[int | None] | None = None,
                     abort_inflight: bool | None = None) -> dict[str, Any]:
        rx = self.receiver
        await asyncio.to_thread(rx.verify, version, checksums)
        engine = self.engine
        was_paused = bool(engine.is_paused)
        try:
            await engine.pause(abort_inflight=self.abort_inflight if abort_inflight is None else abort_inflight)
        except BaseException:
            rx.abort(version, "engine pause failed", force=True)
            if not was_paused:
                await engine.resume()
            raise
        try:
            await asyncio.to_thread(rx.apply, version)
            engine.version = rx.version
            log.info("weights updated to version %d", rx.version)
        finally:
            if not was_paused:
                await engine.resume()
        return {"version": self.version}

    async def abort(self, version: int | None = None, reason: str = "aborted by the sender") -> dict[str, Any]:
        return {"aborted": self.receiver.abort(version, reason), "version": self.version}

    async def checksum(self) -> dict[str, Any]:
        digest = await asyncio.to_thread(self.receiver.digest)
        return {"version": self.version, "digest": digest}

    def close(self) -> None:
        self.receiver.close()


def make_updates(engine: Any, config: Any = None) -> WeightUpdates:
    """WeightUpdates configured from `config` (optional attributes, defaults otherwise)."""
    return WeightUpdates(
        engine,
        timeout_s=float(getattr(config, "weight_sync_timeout_s", 300.0) or 300.0),
        abort_inflight=bool(getattr(config, "weight_sync_abort_inflight", False)),
    )


__all__ = ["WeightUpdates", "make_updates"]
