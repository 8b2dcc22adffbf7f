"""Glue between weight_sync.WeightReceiver and the Engine: the server's update window.

    updates = make_updates(engine, config, metrics=m, executor=pool)   # one per engine core (server.core.engine_core)
    await updates.begin(BeginRequest(...))            # validate against engine.model, stage
    await updates.commit(7, checksums, run_id="r")    # verify -> drain -> apply -> version -> resume

Every call names its run (`run_id`, "" = the anonymous run): a bucket, commit or abort for
an update another run began is weight_sync.NotOwner (409 naming the owner), checked
before anything is read, verified, drained or dropped (weight_sync/receiver.py).

Commit = verify the staged bytes (in the weights pool of server.api.executors: checksums and NaN/inf), then the
drain: admission stops and in-flight sequences get `drain_timeout_s` to finish. Past that
bound, with `abort_inflight` they are aborted (finish_reason "abort") and the update is
applied; without it they finish on the old weights, the commit answers "pending" and the
update is applied in the background as soon as they are done (the sender polls
`GET /weights/updates/{v}`; an abort meanwhile cancels it). The window is the engine's
`apply_update` (drain -> copy -> version -> resume, the engine owning the served version;
the receiver reads it from there): the copy into the model is `dllm.weights.copy_into_model`
(the checkpoint-loading path), then the engine sets the version and resumes -- also on
failure. An engine an admin had paused stays paused. A failed update leaves weights and
version unchanged; a retried commit of an applied version answers "applied".

Rollback (issue 19): after each applied update (and at start) the served weights are
copied to host memory in a worker thread (server.weights.weight_versions, the last
`server.keep_versions`); `rollback(v)` goes through the same `engine.apply_update` window:
it pauses between sequences like a commit, re-checks the kept copy's digest, copies it back
with `copy_into_model`, and the engine serves v. A runner with its own update path
(`runner.apply_weights`: lmdeploy's sleep -> update_params -> wakeup) is used for both instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import torch

from server.config import ServerConfig
from server.engine.backends.base import AppliesWeights
from server.weights.weight_versions import Kept, KeptVersions, NotKept
from weight_sync import UpdateConflict, UpdateFailed, WeightReceiver
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
    UpdatePhase,
    UpdateState,
    VersionResponse,
)
from weight_sync.transports.http import read_body_into

if TYPE_CHECKING:
    from server.engine.engine import Engine
    from server.metrics import ServerMetrics

log = logging.getLogger("dlrl.server")
P = ParamSpec("P")
T = TypeVar("T")
ApplyFn = Callable[[list[tuple[str, torch.Tensor]]], object]  # named tensors -> into the served model


def _hf_tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    from dllm.weights import hf_tensors  # HF names: fused parameters split into views

    return hf_tensors(model)


def _default_apply(engine: Engine) -> ApplyFn:
    """As the runner declares (RunnerInfo.weights): its own `apply_weights` (lmdeploy: its update path), else
    copy_into_model into the served parameters in place."""
    if engine.info.weights == "runner":
        runner = engine.backend
        if not isinstance(runner, AppliesWeights):
            raise TypeError(f"runner {runner.name!r} declares weights='runner' but has no apply_weights")
        return runner.apply_weights
    from dllm.weights import copy_into_model  # the one function that writes parameters

    return lambda named: copy_into_model(engine.model, named, strict=True)


class WeightUpdates:
    def __init__(
        self, engine: Engine, *, lease_s: float = 30.0, drain_timeout_s: float = 30.0, abort_inflight: bool = False,
        check_finite: bool = True, apply_fn: ApplyFn | None = None, keep_versions: int = 0,
        metrics: ServerMetrics | None = None, executor: Executor | None = None,
    ):
        self.engine = engine
        self.kept = KeptVersions(keep_versions)
        self._capture_task: asyncio.Future[None] | None = None
        self._write_lock = asyncio.Lock()        # one weight change at a time (commit apply or rollback)
        self._weights_lock = threading.Lock()    # held while a rollback copies or a digest reads
        self.abort_inflight, self.drain_timeout_s = abort_inflight, drain_timeout_s
        self.apply_fn = apply_fn or _default_apply(engine)  # updates and rollbacks alike
        self.receiver = WeightReceiver(
            lambda: dict(_hf_tensors(engine.model)), self.apply_fn,
            served_version=lambda: int(engine.version), lease_s=lease_s, check_finite=check_finite,
        )
        self._commits: dict[int, asyncio.Task[None]] = {}
        self._verify_s = 0.0
        self.metrics = metrics  # update counts and timings (the engine core's registry); None: not counted
        self.executor = executor  # the engine core's weights pool; None = the loop's default
        self._bytes: dict[int, int] = {}  # version -> manifest total_bytes, until applied

    async def _run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Blocking work in the weights pool (a hung store elsewhere cannot hold its threads)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def _refused(self, step: str) -> None:
        if self.metrics is not None:
            self.metrics.update_refusals.labels(step=step).inc()

    @property
    def version(self) -> int:
        return int(self.engine.version)

    async def status(self) -> VersionResponse:
        status = {**self.receiver.status(), "is_paused": bool(self.engine.is_paused)}  # version: the engine's
        return VersionResponse.model_validate(status)

    async def state(self, version: int) -> UpdateState:
        return UpdateState.model_validate(self.receiver.state(version))  # served_version: the engine's

    async def connect(self, body: ConnectRequest) -> ConnectResponse:
        out = await self._run(self.receiver.connect, body.transport, body.manifest, body.options, body.run_id)
        return ConnectResponse.model_validate(out)

    async def begin(self, body: BeginRequest) -> BeginResponse:
        try:
            out = await self._run(self.receiver.begin, body.version, body.transport, body.manifest,
                                  body.options, body.lease_s, body.run_id)
        except Exception:
            self._refused("begin")
            raise
        begun = BeginResponse.model_validate(out)
        self._bytes = {body.version: begun.total_bytes}
        return begun

    async def put_bucket(
        self, index: int, stream: AsyncIterator[bytes], version: int | None, checksum: int | None, run_id: str = "",
    ) -> BucketResponse:
        """http data plane: stream one request body into the staging bucket (owner only), then verify it."""
        buf = self.open_bucket(index, version, run_id)  # NotOwner before a byte is read
        try:
            nbytes = await read_body_into(stream, buf, self.receiver.touch)
        except BaseException:
            await self.bucket_done(index, None, None, version, run_id)  # releases the bucket
            raise
        return await self.bucket_done(index, nbytes, checksum, version, run_id)

    def open_bucket(self, index: int, version: int | None, run_id: str = "") -> torch.Tensor:
        """The staging buffer ([nbytes] uint8) bucket `index` is written into (NotOwner: another run's update)."""
        return self.receiver.bucket_buffer(index, version, run_id)

    async def bucket_done(self, index: int, nbytes: int | None, checksum: int | None, version: int | None,
                          run_id: str = "") -> BucketResponse:
        """A bucket's body ended (`nbytes` None: it failed half-way, the bucket is released): check it."""
        if nbytes is None:
            self.receiver.bucket_written(index, None, None, version, run_id)
            return BucketResponse(index=index, nbytes=0)
        await self._run(self.receiver.bucket_written, index, nbytes, checksum, version, run_id)
        return BucketResponse(index=index, nbytes=nbytes)

    async def commit(self, version: int, checksums: list[int | None] | None = None,
                     abort_inflight: bool | None = None, run_id: str = "") -> CommitResponse:
        """Verify, drain (bounded), apply. Returns state "applied" | "pending".
        NotOwner (409) when `version` (in progress, pending or applied) belongs to another run."""
        abort = self.abort_inflight if abort_inflight is None else abort_inflight
        self.receiver.check_owner(version, run_id)  # before anything: a foreign commit changes nothing
        task = self._commits.get(version)
        if task is None:
            if self.receiver.committed(version) and version <= self.version:  # above: applied, then rolled back
                return CommitResponse(version=version, state="applied", served_version=self.version)
            t0 = time.perf_counter()
            try:
                await self._run(self.receiver.verify, version, checksums, run_id)
            except Exception:
                self._refused("commit")
                raise
            self._verify_s = time.perf_counter() - t0
            task = self._commits[version] = asyncio.create_task(self._drain_and_apply(version, abort))
            task.add_done_callback(lambda _t: self._commits.pop(version, None))
        bound = self.drain_timeout_s * (2 if abort else 1) + 2.0
        try:
            await asyncio.wait_for(asyncio.shield(task), bound)
        except TimeoutError:
            return CommitResponse(version=version, state="pending", served_version=self.version)
        return CommitResponse(version=version, state="applied", served_version=self.version)

    async def _drain_and_apply(self, version: int, abort: bool) -> None:
        await self.wait_capture()
        async with self._write_lock:
            await self._drain_and_apply_locked(version, abort)
        self.start_capture()  # keep the new version for rollback (reads the weights while serving)

    async def _drain_and_apply_locked(self, version: int, abort: bool) -> None:
        rx = self.receiver
        rx.set_draining(version)
        times = [time.perf_counter()]

        async def drain() -> None:
            await self._drain(version, abort)
            times.append(time.perf_counter())

        try:
            await self.engine.apply_update(version, lambda: rx.apply(version), drain)
        except BaseException as e:
            if rx.state(version)["state"] in (UpdatePhase.DRAINING, UpdatePhase.VERIFIED):
                rx.abort(version, f"drain failed: {e!r}")
            if self.metrics is not None:
                self.metrics.updates.labels(outcome="failed").inc()
            raise
        drain_s, apply_s = times[1] - times[0], time.perf_counter() - times[1]
        self._observe_applied(version, drain_s, apply_s)
        log.info("weights updated to version %d (verify %.3fs, drain %.3fs, apply %.3fs)", self.version,
                 self._verify_s, drain_s, apply_s)

    def _observe_applied(self, version: int, drain_s: float, apply_s: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.updates.labels(outcome="applied").inc()
        m.update_bytes.inc(self._bytes.pop(version, 0))
        for phase, seconds in (("verify", self._verify_s), ("drain", drain_s), ("apply", apply_s)):
            m.update_seconds[phase].observe(seconds)

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
            if self.receiver.state(version)["state"] is not UpdatePhase.DRAINING:
                raise UpdateFailed(f"update {version} was aborted while in-flight sequences drained")
            try:
                await self.engine.pause(abort_inflight=False, timeout=1.0)
                return
            except TimeoutError:
                continue

    async def abort(self, version: int | None = None, reason: str = "aborted by the sender",
                    run_id: str | None = "") -> AbortResponse:
        """Abort the update of `run_id` (NotOwner: another run's); aborted False when none matches."""
        aborted = await self._run(self.receiver.abort, version, reason, run_id)
        if aborted and self.metrics is not None:
            self.metrics.update_aborts.inc()
        return AbortResponse(aborted=aborted, version=self.version)

    async def checksum(self) -> ChecksumResponse:
        def digest() -> str:
            with self._weights_lock:
                return self.receiver.digest()

        return ChecksumResponse(version=self.version, digest=await self._run(digest))

    # ------------------------------------------------------------------ kept versions, rollback
    def start_capture(self) -> None:
        """Copy the served weights to host memory as the current version, in a worker thread."""
        if self.kept.keep == 0:
            return
        version, model = self.version, self.engine.model

        def capture() -> None:
            with self._weights_lock:
                self.kept.capture(version, _hf_tensors(model))

        self._capture_task = asyncio.ensure_future(self._run(capture))

    async def wait_capture(self) -> None:
        """Wait for a capture in progress (the weights must not change under it)."""
        task = self._capture_task
        if task is not None:
            try:
                await asyncio.shield(task)
            except Exception as e:  # a failed capture only means that version cannot be rolled back to
                log.error("keeping version for rollback failed: %r", e)
            self._capture_task = None

    async def kept_status(self) -> KeptResponse:
        return KeptResponse(versions=self.kept.versions(), served_version=self.version, keep=self.kept.keep,
                            num_bytes=self.kept.num_bytes)

    async def rollback(self, version: int, abort_inflight: bool | None = None) -> RollbackResponse:
        """Restore kept `version` (NotKept: 404; UpdateConflict: an update is in progress or
        in-flight sequences did not drain): pause between sequences, copy_into_model, resume."""
        await self.wait_capture()
        if self.kept.get(version) is None:  # before anything is paused
            raise NotKept(f"version: {version} is not kept here (kept: {self.kept.versions()})")
        if self._write_lock.locked() or self.receiver.status()["update"] is not None:
            raise UpdateConflict("a weight update is in progress; roll back after it (or abort it)")
        abort = self.abort_inflight if abort_inflight is None else abort_inflight
        async with self._write_lock:
            t0, previous = time.perf_counter(), self.version
            kept = await self.engine.apply_update(version, lambda: self._restore(version),
                                                  lambda: self._pause_for_rollback(abort))
            self.kept.touch(version)
        seconds = time.perf_counter() - t0
        log.info("rolled back from version %d to %d in %.3fs", previous, version, seconds)
        return RollbackResponse(version=version, previous_version=previous, digest=kept.digest, seconds=seconds)

    async def _pause_for_rollback(self, abort: bool) -> None:
        try:
            await self.engine.pause(abort_inflight=False, timeout=self.drain_timeout_s)
        except TimeoutError:
            if not abort:
                raise UpdateConflict(f"in-flight sequences did not finish within {self.drain_timeout_s}s; "
                                     "retry, or pass abort_inflight") from None
            await self.engine.pause(abort_inflight=True, timeout=self.drain_timeout_s)

    def _restore(self, version: int) -> Kept:
        with self._weights_lock:
            kept = self.kept.verified(version)
            self.apply_fn(list(kept.tensors.items()))  # copy_into_model, or the runner's own path
        return kept

    def close(self) -> None:
        self.receiver.close()


def make_updates(engine: Engine, config: ServerConfig, *, metrics: ServerMetrics | None = None,
                 executor: Executor | None = None) -> WeightUpdates:
    """WeightUpdates configured from `config` (its weight_sync_* keys and keep_versions)."""
    return WeightUpdates(
        engine, lease_s=config.weight_sync_lease_s, drain_timeout_s=config.weight_sync_drain_timeout_s,
        abort_inflight=config.weight_sync_abort_inflight, check_finite=config.weight_sync_check_finite,
        keep_versions=config.keep_versions, metrics=metrics, executor=executor,
    )


__all__ = ["WeightUpdates", "make_updates"]
