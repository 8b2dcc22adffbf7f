"""Server side of a weight update: validate, stage privately, verify, apply atomically, or leave untouched.

    rx = WeightReceiver(lambda: dict(model.hf_named_tensors()),
                        functools.partial(copy_into_model, model), served_version=lambda: engine.version)
    rx.connect("shm", manifest, options)           # once: attach region / size staging / join group
    rx.begin(7, "http", manifest_json, run_id="tiny-rl")   # 409 stale/busy, 400 bad manifest
    buf = rx.bucket_buffer(0, 7); ...; rx.bucket_written(0, nbytes, checksum)   # http data plane
    rx.commit(7, checksums)                        # = verify() + apply(): the weights of 7 are in the model
    rx.state(7)                                    # {"state": "applied", ...}: commit is queryable

State machine (one update at a time; weight_sync/staging.py holds its state; the phases are
`weight_sync.protocol.UpdatePhase`): receiving (begin) -> verifying -> verified (verify) ->
draining (the server waits for in-flight sequences) -> applying -> applied (apply); or
failed (abort, bad data, lapsed lease, apply error; never once applying). A failed update
leaves the weights unchanged. Outcomes of recent versions are kept, so a retried commit of
an applied version succeeds and `state(v)` tells the sender what happened.

The served version is not the receiver's: it reads it from `served_version()` (the
server's engine, which sets it once the copy of `apply` returned: server.weights.weight_updates),
for the stale-begin check and in what it reports.

Lease: an update lives while its data plane makes progress (http chunks, dist buckets,
the shm heartbeat); `lease_s` without progress while receiving aborts it.
Ownership: the update belongs to the `run_id` of its begin ("" is the anonymous run).
Every call about it -- bucket data (http), commit (verify), abort -- names its run and is
checked before it touches anything: another run's call is `NotOwner` (409 naming the
owner). A begin or connect is checked in full (other run's live update, stale version,
manifest, transport options) before it changes anything; only then does a begin from the
same run as the update in progress (still receiving) take it over (a resumed trainer),
and another run waits for that update's lease to lapse. `abort(run_id=None)` (the
server's own calls) ignores the owner.
Staging: every transport stages into private per-bucket buffers (on the model's device for
NCCL), allocated at connect/first begin and kept for the next update of the same layout;
verification hashes exactly those bytes, and NaN/inf are refused (`check_finite`). shm
copies a bucket into staging (hashing it) as soon as the sender marks it ready, while the
sender packs the next one; dist hashes each bucket as it lands; http as its body ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weight_sync.errors import ManifestError, NotOwner, UpdateConflict, UpdateFailed
from weight_sync.manifest import Manifest, check_against, served_dtype, weights_digest
from weight_sync.protocol import UpdatePhase
from weight_sync.staging import Outcomes, StagedUpdate, StagingPool
from weight_sync.transports import TRANSPORTS
from weight_sync.transports.dist import DistReceiver
from weight_sync.transports.shm import ShmReader, sweep

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def _parse(manifest: Manifest | dict | str | bytes) -> Manifest:
    if isinstance(manifest, Manifest):
        return manifest
    return Manifest.from_json(manifest) if isinstance(manifest, str | bytes) else Manifest.from_dict(manifest)


class WeightReceiver:
    def __init__(self, named_params_fn: Callable[[], NamedTensors | dict[str, torch.Tensor]],
                 apply_fn: Callable[[list[tuple[str, torch.Tensor]]], Any], *, served_version: Callable[[], int],
                 lease_s: float = 30.0, staging_device: str | torch.device = "cpu", keep_staging: bool = True,
                 check_finite: bool = True):
        self._params_fn, self._apply_fn = named_params_fn, apply_fn
        self._served_version = served_version  # the server's engine owns it; the receiver only reads it
        self.lease_s, self.staging_device = lease_s, torch.device(staging_device)
        self.check_finite = check_finite
        self._lock = threading.RLock()
        self._apply_lock = threading.Lock()  # held while weights change (and while digesting)
        self._update: StagedUpdate | None = None
        self._outcomes = Outcomes()
        self.last_failure = ""
        self._shm, self._dist = ShmReader(), DistReceiver()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="weight-sync-scan")  # dist: as buckets land
        self._staging = StagingPool(keep=keep_staging)

    # ------------------------------------------------------------------ queries
    def status(self) -> dict[str, Any]:
        with self._lock:
            u = self._update
            info = None if u is None else {
                "version": u.version, "transport": u.transport, "phase": u.phase, "run_id": u.run_id,
                "buckets_received": sum(u.received), "num_buckets": len(u.received),
                "lease_left_s": round(u.lease_left(), 3)}
            return {"version": self._served_version(), "update": info, "last_failure": self.last_failure,
                    "dtype": served_dtype(self._params())}

    def state(self, version: int) -> dict[str, Any]:
        """What became of `version`: receiving ... applying, applied, failed, or unknown."""
        with self._lock:
            u = self._update
            if u is not None and u.version == version:
                out = {"state": u.phase, "reason": "", "run_id": u.run_id}
            else:
                out = self._outcomes.get(version)
            return {"version": version, **out, "served_version": self._served_version()}

    def check_owner(self, version: int, run_id: str) -> None:
        """NotOwner unless `version` (in progress, or its recorded outcome) belongs to `run_id`."""
        with self._lock:
            u = self._update
            owner: str | None
            if u is not None and u.version == version:
                owner = u.run_id
            else:
                out = self._outcomes.get(version)
                owner = None if out["state"] is UpdatePhase.UNKNOWN else out["run_id"]
            if owner is not None and owner != run_id:
                raise NotOwner(version, owner, run_id)

    def committed(self, version: int) -> bool:
        """True when `version` was applied here (a retried commit of it is a success)."""
        with self._lock:
            return self._outcomes.get(version)["state"] is UpdatePhase.APPLIED

    def digest(self) -> str:
        with self._apply_lock:
            return weights_digest(self._params())

    def _params(self) -> dict[str, torch.Tensor]:
        p = self._params_fn()
        return dict(p.items() if isinstance(p, dict) else p)

    def _current(self, version: int | None, *phases: UpdatePhase, run_id: str | None = None) -> StagedUpdate:
        u = self._update
        if u is None:
            last = f" (last failure: {self.last_failure})" if self.last_failure else ""
            raise UpdateConflict(f"no weight update in progress; call begin first{last}")
        if run_id is not None and run_id != u.run_id:
            raise NotOwner(u.version, u.run_id, run_id)
        if version is not None and version != u.version:
            raise UpdateConflict(f"version: the update in progress is {u.version}, request says {version}")
        if phases and u.phase not in phases:
            raise UpdateConflict(f"update {u.version} is {u.phase}, expected {' or '.join(phases)}")
        return u

    def _drop(self, u: StagedUpdate, reason: str | None) -> None:
        """Forget update `u` (lock held). Weights were not touched, so nothing to undo."""
        if self._update is not u:
            return
        self._update = None
        if reason:
            self.last_failure = f"update to version {u.version} aborted: {reason}"
            self._outcomes.record(u.version, UpdatePhase.FAILED, reason, u.run_id)
        u.stop.set()
        if u.transport == "dist" and not u.done.is_set():
            self._dist.drop()  # the collective sequence is broken: the next push reconnects
            self._staging.invalidate()  # a late broadcast may still land in this staging
        if u.writing or u.phase == UpdatePhase.VERIFYING or (u.sources is not None and not u.staged.is_set()):
            self._staging.invalidate()  # an http body / an shm copy may still write into this staging
        u.named = []
        u.done.set()

    # ------------------------------------------------------------------ setup
    def _stage(self, transport: str, m: Manifest, options: dict, device: torch.device) -> list[torch.Tensor]:
        """Private per-bucket staging (on the model's device for NCCL), reused across updates."""
        nccl = transport == "dist" and options.get("backend") == "nccl"
        return self._staging.get(device if nccl else self.staging_device, m)

    def connect(self, transport: str, manifest: Manifest | dict | str, options: dict[str, Any] | None = None,
                run_id: str = "") -> dict[str, Any]:
        """Prepare the data plane before the first update: attach the region, size the staging, join."""
        m, options = _parse(manifest), options or {}
        if transport not in TRANSPORTS:
            raise ManifestError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
        with self._lock:
            stale = self._claimable(run_id)  # another run's live update: 409 (the sender waits for its lease)
            device = check_against(m, self._params())
            self._check_options(transport, options, m)
            self._take_over(stale, run_id, "connect")  # everything checked: only now drop the same run's update
            if transport == "shm":
                sweep()
                self._shm.buckets(options, m)
            elif transport == "dist":
                self._dist.connect(options, device)
            staging = self._stage(transport, m, options, device)
            return {"transport": transport, "num_buckets": len(staging), "total_bytes": m.total_bytes,
                    "staging_bytes": sum(s.numel() for s in staging)}

    def begin(self, version: int, transport: str, manifest: Manifest | dict | str,
              options: dict[str, Any] | None = None, lease_s: float | None = None,
              run_id: str = "") -> dict[str, Any]:
        """Validate `manifest` against the served model and open staging (ManifestError / 409)."""
        m, options = _parse(manifest), options or {}
        if transport not in TRANSPORTS:
            raise ManifestError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
        if m.version != version:
            raise ManifestError(f"manifest.version: {m.version} != request version {version}")
        with self._lock:
            stale = self._claimable(run_id)  # another run's live update: 409, nothing changed
            served = self._served_version()
            if version <= served:
                raise UpdateConflict(f"version: {version} is not greater than the current version {served}")
            device = check_against(m, self._params())
            self._check_options(transport, options, m)
            if transport == "dist":
                self._dist.check(options)
            took_over = self._take_over(stale, run_id)  # a valid begin: only now replace the same run's update
            sources = None
            if transport == "shm":
                sweep()
                sources = self._shm.buckets(options, m)
            elif transport == "dist" and took_over is not None:
                self._dist.check(options)  # a dropped dist update broke the collective sequence: reconnect (409)
            staging = self._stage(transport, m, options, device)
            u = StagedUpdate(version, transport, m, staging, float(lease_s or self.lease_s), run_id, sources)
            u.heartbeat = self._shm.heartbeat() if sources is not None else 0
            self._update = u
            self._arm(u)
            if transport == "shm":
                threading.Thread(target=self._stage_shm, args=(u,), daemon=True, name="weight-sync-shm").start()
            if transport == "dist":
                self._dist.start(staging, lambda i: self._on_bucket(u, i), lambda e: self._on_done(u, e), u.stop)
            return {"version": version, "transport": transport, "num_buckets": len(staging),
                    "total_bytes": m.total_bytes, "run_id": run_id, "lease_s": u.lease_s, "took_over": took_over}

    def _claimable(self, run_id: str) -> StagedUpdate | None:
        """The update a begin/connect of `run_id` may take over (None: none runs); 409 if it may not:
        another run's (it waits for the lease), or one past receiving. Changes nothing."""
        u = self._update
        if u is None:
            return None
        if run_id and u.run_id == run_id and u.phase == UpdatePhase.RECEIVING:
            return u
        who = f" by run {u.run_id!r}" if u.run_id else " by the anonymous run ''"
        raise UpdateConflict(f"an update to version {u.version}{who} is already {u.phase} (lease "
                             f"{u.lease_left():.1f}s left); abort it, wait for the lease, or begin from the same run")

    def _take_over(self, u: StagedUpdate | None, run_id: str, call: str = "begin") -> int | None:
        """Drop the same run's update `u` (from _claimable) once the new call was checked in full."""
        if u is None or self._update is not u:
            return None
        self._drop(u, f"superseded by a new {call} of run {run_id!r}")
        return u.version

    def _check_options(self, transport: str, options: dict[str, Any], m: Manifest) -> None:
        """Transport options, checked without side effects (ManifestError naming the option)."""
        if transport == "shm":
            self._shm.check(options, m)
        elif transport == "dist":
            DistReceiver.validate(options)

    # ------------------------------------------------------------------ lease
    def _arm(self, u: StagedUpdate) -> None:
        timer = threading.Timer(max(0.05, min(u.deadline - time.monotonic(), 1.0)), self._on_timer, args=(u,))
        timer.daemon = True
        timer.start()

    def _on_timer(self, u: StagedUpdate) -> None:
        with self._lock:
            if self._update is not u or u.phase != UpdatePhase.RECEIVING:
                return
            if u.sources is not None:  # shm: the sender's heartbeat is the data plane's progress
                beat = self._shm.heartbeat()
                if beat != u.heartbeat:
                    u.heartbeat = beat
                    u.renew()
            if time.monotonic() < u.deadline:
                self._arm(u)
                return
            who = f" from run {u.run_id!r}" if u.run_id else ""
            self._drop(u, f"lease expired: no data{who} for {u.lease_s:g}s")

    def _stage_shm(self, u: StagedUpdate) -> None:
        """Copy each bucket the sender marked ready into private staging (hashing it) while the
        sender packs the next; stops when the commit arrives, which then stages the rest."""
        try:
            index = 0
            while index < len(u.staging) and not u.stop.is_set():
                if self._shm.ready(index) != u.version:
                    if u.phase != UpdatePhase.RECEIVING:
                        break
                    time.sleep(0.001)
                    continue
                digest, bad = u.scan(index, self.check_finite)
                with self._lock:
                    if self._update is not u:
                        break
                    u.record(index, digest, bad)
                    u.renew()
                index += 1
        finally:
            u.staged.set()

    def touch(self) -> None:
        """Data-plane progress outside the receiver (a streaming http body): renew the lease."""
        with self._lock:
            if self._update is not None and self._update.phase == UpdatePhase.RECEIVING:
                self._update.renew()

    # ------------------------------------------------------------------ data planes
    def _on_bucket(self, u: StagedUpdate, index: int) -> None:
        with self._lock:
            if self._update is u:
                u.received[index] = True
                u.renew()
                u.pending[index] = self._pool.submit(u.scan, index, self.check_finite)  # overlaps the next bucket

    def _on_done(self, u: StagedUpdate, error: BaseException | None) -> None:
        with self._lock:
            u.error = error
            if error is not None and self._update is u and u.phase in (UpdatePhase.RECEIVING,
                                                                       UpdatePhase.VERIFYING):
                self._drop(u, f"dist receive failed: {error}")
            u.done.set()

    def bucket_buffer(self, index: int, version: int | None = None, run_id: str | None = "") -> torch.Tensor:
        """Staging tensor ([nbytes] uint8) the http route streams bucket `index` into (owner: `run_id`)."""
        with self._lock:
            u = self._current(version, UpdatePhase.RECEIVING, run_id=run_id)
            if u.transport != "http":
                raise UpdateConflict(f"transport: update {u.version} uses {u.transport!r}, not 'http'")
            if not 0 <= index < len(u.staging):
                raise UpdateFailed(f"bucket index {index} out of range [0, {len(u.staging)})")
            if index in u.writing:
                raise UpdateConflict(f"bucket {index} is already being written")
            u.writing.add(index)
            u.received[index], u.digests[index] = False, None
            u.nonfinite.pop(index, None)
            u.renew()
            return u.staging[index]

    def bucket_written(self, index: int, nbytes: int | None, checksum: int | None, version: int | None = None,
                       run_id: str | None = "") -> None:
        """Finish bucket `index` (nbytes=None: the transfer failed, just release it). Bad data raises."""
        with self._lock:
            u = self._current(version, UpdatePhase.RECEIVING, run_id=run_id)
            u.writing.discard(index)
            buf = u.staging[index]
        if nbytes is None:
            return
        if nbytes != buf.numel():
            raise UpdateFailed(f"bucket {index}: truncated, got {nbytes} of {buf.numel()} bytes")
        digest, bad = u.scan(index, self.check_finite)
        if checksum is not None and digest != checksum:
            raise UpdateFailed(f"bucket {index}: checksum mismatch (got {digest}, header says {checksum})")
        with self._lock:
            if self._update is u:
                u.received[index] = True
                u.record(index, digest, bad)
                if checksum is not None:
                    u.expect(index, checksum)
                u.renew()

    # ------------------------------------------------------------------ commit
    def verify(self, version: int, checksums: list[int | None] | None = None, run_id: str | None = "") -> None:
        """Commit, phase 1: wait for the data, stage and check completeness, checksums, finiteness."""
        with self._lock:
            u = self._current(version, UpdatePhase.RECEIVING, run_id=run_id)
            if u.writing:
                raise UpdateConflict(f"buckets {sorted(u.writing)} are still being written")
            u.phase = UpdatePhase.VERIFYING  # the lease no longer applies: the server is doing the work
        try:
            if u.transport == "dist":
                self._wait_dist(u)
            if u.transport == "shm":
                u.staged.wait()  # the staging thread has stopped: nothing writes the staging but us
            if u.error is not None:
                raise UpdateFailed(f"dist receive failed: {u.error}")
            u.verify(checksums, self.check_finite, self._pool)
        except UpdateFailed as e:
            with self._lock:
                self._drop(u, str(e))
            raise
        with self._lock:
            if self._update is not u:  # aborted meanwhile
                raise UpdateFailed(f"update {version} was aborted: {self.last_failure}")
            u.phase = UpdatePhase.VERIFIED
            u.named = u.views()

    def _wait_dist(self, u: StagedUpdate) -> None:
        while not u.done.wait(0.05):
            if time.monotonic() > u.deadline:  # the receive thread extends it per bucket
                raise UpdateFailed(f"dist data did not arrive within the {u.lease_s:g}s lease")

    def set_draining(self, version: int) -> None:
        """The server is waiting for in-flight sequences before apply (still abortable)."""
        with self._lock:
            self._current(version, UpdatePhase.VERIFIED).phase = UpdatePhase.DRAINING

    def apply(self, version: int) -> None:
        """Commit, phase 2 (engine paused): apply_fn(named views of the staging). The caller then serves
        `version` (server.engine.engine.Engine.apply_update sets it once this returned)."""
        with self._lock:
            u = self._current(version, UpdatePhase.VERIFIED, UpdatePhase.DRAINING)
            u.phase = UpdatePhase.APPLYING
        try:
            with self._apply_lock:
                self._apply_fn(u.named)
        except Exception as e:
            with self._lock:
                self._drop(u, f"apply failed: {e}")
            raise UpdateFailed(f"update {version}: apply failed: {e}") from e
        with self._lock:
            self._outcomes.record(u.version, UpdatePhase.APPLIED, run_id=u.run_id)
            self._drop(u, None)

    def commit(self, version: int, checksums: list[int | None] | None = None, run_id: str = "") -> None:
        self.check_owner(version, run_id)
        if self.committed(version):
            return
        self.verify(version, checksums, run_id)
        self.apply(version)

    def abort(self, version: int | None = None, reason: str = "aborted by the sender",
              run_id: str | None = None) -> bool:
        """Drop the update in progress (any version when `version` is None); False if none matches.
        NotOwner if it belongs to another run than `run_id` (None: the server itself, any run)."""
        with self._lock:
            u = self._update
            if u is None or (version is not None and version != u.version):
                return False
            if run_id is not None and run_id != u.run_id:
                raise NotOwner(u.version, u.run_id, run_id)
            if u.phase == UpdatePhase.APPLYING:
                raise UpdateConflict(f"update {u.version} is applying; it can no longer be aborted")
            self._drop(u, reason)
        if u.sources is not None:
            sweep()
        return True

    def close(self) -> None:
        with self._lock:
            if self._update is not None:
                self._drop(self._update, "receiver closed")
            self._shm.close()
            self._dist.close()
            self._staging.invalidate()
        self._pool.shutdown(wait=False)
