"""Server side of a weight update: validate, stage, verify, apply atomically, or leave untouched.

    rx = WeightReceiver(lambda: dict(model.named_parameters()),
                        functools.partial(copy_into_model, model), version=0)
    rx.begin(7, "http", manifest_json)            # 409 stale/concurrent, 400 bad manifest
    buf = rx.bucket_buffer(0, 7); ...; rx.bucket_written(0, nbytes, crc)   # http data plane
    rx.commit(7, checksums)                       # = verify() + apply(): version becomes 7

State machine (state of one update: weight_sync/staging.py): idle -> receiving (begin)
-> verifying -> verified (verify) -> applying -> idle (apply), or -> idle (abort, failure,
timeout; not once applying). One update at a time. Failing a check, an abort, a dist receive error or `timeout_s`
without progress all drop the staging and leave weights and version unchanged. The
server splits commit into `verify()` (heavy, in a thread), engine pause, `apply()`.
Staging: shm applies straight from the shared region; dist/http receive into
per-bucket uint8 tensors (on the model's device for NCCL), kept for the next update of
the same layout unless `keep_staging=False` (costs model-size memory, saves page faults).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weight_sync.errors import ManifestError, UpdateConflict, UpdateFailed
from weight_sync.manifest import Manifest, check_against, crc32, served_dtype, weights_digest
from weight_sync.staging import StagedUpdate
from weight_sync.transports import TRANSPORTS
from weight_sync.transports.dist import DistReceiver
from weight_sync.transports.shm import ShmReader

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightReceiver:
    def __init__(self, named_params_fn: Callable[[], NamedTensors | dict[str, torch.Tensor]],
                 apply_fn: Callable[[list[tuple[str, torch.Tensor]]], Any], *, version: int = 0,
                 timeout_s: float = 300.0, staging_device: str | torch.device = "cpu", keep_staging: bool = True):
        self._params_fn, self._apply_fn = named_params_fn, apply_fn
        self._version, self.timeout_s, self.staging_device = version, timeout_s, torch.device(staging_device)
        self._lock = threading.RLock()
        self._apply_lock = threading.Lock()  # held while weights change (and while digesting)
        self._update: StagedUpdate | None = None
        self.last_failure = ""
        self._shm, self._dist = ShmReader(), DistReceiver()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="weight-sync-crc")
        self.keep_staging = keep_staging  # reuse staging buffers across updates (no page faults)
        self._staging_cache: tuple[tuple, list[torch.Tensor]] | None = None

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """Re-sync with the served version (e.g. the engine's); only while no update runs."""
        with self._lock:
            if self._update is not None:
                raise UpdateConflict(f"cannot set the version while update {self._update.version} runs")
            self._version = value

    def status(self) -> dict[str, Any]:
        with self._lock:
            u = self._update
            info = None if u is None else {"version": u.version, "transport": u.transport, "phase": u.phase,
                                           "buckets_received": sum(u.received), "num_buckets": len(u.received)}
            return {"version": self._version, "update": info, "last_failure": self.last_failure,
                    "dtype": served_dtype(self._params())}

    def digest(self) -> str:
        with self._apply_lock:
            return weights_digest(self._params())

    def _params(self) -> dict[str, torch.Tensor]:
        p = self._params_fn()
        return dict(p.items() if isinstance(p, dict) else p)

    def _current(self, version: int | None, phase: str) -> StagedUpdate:
        u = self._update
        if u is None:
            last = f" (last failure: {self.last_failure})" if self.last_failure else ""
            raise UpdateConflict(f"no weight update in progress; call begin first{last}")
        if version is not None and version != u.version:
            raise UpdateConflict(f"version: the update in progress is {u.version}, request says {version}")
        if u.phase != phase:
            raise UpdateConflict(f"update {u.version} is {u.phase}, expected {phase}")
        return u

    def _drop(self, u: StagedUpdate, reason: str | None) -> None:
        """Forget update `u` (lock held). Weights were not touched, so nothing to undo."""
        if self._update is not u:
            return
        self._update = None
        if reason:
            self.last_failure = f"update to version {u.version} aborted: {reason}"
        if u.transport == "dist" and not u.done.is_set():
            self._dist = DistReceiver()  # the blocked thread keeps (and later drops) the old group
            self._staging_cache = None  # ... and may still write into this staging
        if u.writing:
            self._staging_cache = None  # an http body is still streaming into this staging
        u.staging, u.named = [], []
        u.done.set()

    def begin(self, version: int, transport: str, manifest: Manifest | dict | str,
              options: dict[str, Any] | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """Validate `manifest` against the served model and open staging (ManifestError / 409)."""
        if not isinstance(manifest, Manifest):
            manifest = Manifest.from_json(manifest) if isinstance(manifest, str | bytes) else Manifest.from_dict(manifest)
        if transport not in TRANSPORTS:
            raise ManifestError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
        if manifest.version != version:
            raise ManifestError(f"manifest.version: {manifest.version} != request version {version}")
        options = options or {}
        timeout = float(timeout_s or self.timeout_s)
        with self._lock:
            if self._update is not None:
                u = self._update
                raise UpdateConflict(f"an update to version {u.version} is already {u.phase}; abort it first")
            if version <= self._version:
                raise UpdateConflict(f"version: {version} is not greater than the current version {self._version}")
            device = check_against(manifest, self._params())
            if transport == "dist":
                self._dist.check(options)
            staging = self._stage(transport, manifest, options, device)
            u = StagedUpdate(version, transport, manifest, staging, timeout, time.monotonic() + timeout,
                        received=[transport == "shm"] * len(staging), crc=[None] * len(staging),
                        expected=[b.checksum for b in manifest.buckets])
            self._update = u
            self._arm(u)
            if transport == "dist":
                self._dist.start(options, staging, lambda i: self._on_bucket(u, i), lambda e: self._on_done(u, e))
            return {"version": version, "transport": transport, "num_buckets": len(staging),
                    "total_bytes": manifest.total_bytes}

    def _stage(self, transport: str, m: Manifest, options: dict, device: torch.device) -> list[torch.Tensor]:
        if transport == "shm":
            return self._shm.buckets(options, m)
        dev = device if transport == "dist" and options.get("backend") == "nccl" else self.staging_device
        key = (dev, tuple(b.nbytes for b in m.buckets))
        if self._staging_cache is not None and self._staging_cache[0] == key:
            return self._staging_cache[1]
        self._staging_cache = None
        try:
            staging = [torch.empty(b.nbytes, dtype=torch.uint8, device=dev) for b in m.buckets]
        except RuntimeError as e:  # out of memory
            raise UpdateFailed(f"cannot allocate {m.total_bytes} staging bytes on {dev}: {e}") from None
        if self.keep_staging:
            self._staging_cache = (key, staging)
        return staging

    def _arm(self, u: StagedUpdate) -> None:
        timer = threading.Timer(max(0.05, u.deadline - time.monotonic()), self._on_timer, args=(u,))
        timer.daemon = True
        timer.start()

    def _on_timer(self, u: StagedUpdate) -> None:
        with self._lock:
            if self._update is not u or u.phase != "receiving":
                return
            if time.monotonic() < u.deadline:
                self._arm(u)
                return
            self._drop(u, f"timed out: no progress for {u.timeout_s:g}s")

    def _on_bucket(self, u: StagedUpdate, index: int) -> None:
        with self._lock:
            if self._update is u:
                u.received[index] = True
                u.deadline = time.monotonic() + u.timeout_s
                u.pending[index] = self._pool.submit(crc32, u.staging[index].cpu())  # overlaps the next bucket

    def _on_done(self, u: StagedUpdate, error: BaseException | None) -> None:
        with self._lock:
            u.error = error
            if error is not None and self._update is u and u.phase in ("receiving", "verifying"):
                self._drop(u, f"dist receive failed: {error}")
            u.done.set()

    def bucket_buffer(self, index: int, version: int | None = None) -> torch.Tensor:
        """Staging tensor ([nbytes] uint8) the http route streams bucket `index` into."""
        with self._lock:
            u = self._current(version, "receiving")
            if u.transport != "http":
                raise UpdateConflict(f"transport: update {u.version} uses {u.transport!r}, not 'http'")
            if not 0 <= index < len(u.staging):
                raise UpdateFailed(f"bucket index {index} out of range [0, {len(u.staging)})")
            if index in u.writing:
                raise UpdateConflict(f"bucket {index} is already being written")
            u.writing.add(index)
            u.received[index] = False
            u.deadline = time.monotonic() + u.timeout_s
            return u.staging[index]

    def bucket_written(self, index: int, nbytes: int | None, checksum: int | None, version: int | None = None) -> None:
        """Finish bucket `index` (nbytes=None: the transfer failed, just release it). Bad data raises."""
        with self._lock:
            u = self._current(version, "receiving")
            u.writing.discard(index)
            buf = u.staging[index]
        if nbytes is None:
            return
        if nbytes != buf.numel():
            raise UpdateFailed(f"bucket {index}: truncated, got {nbytes} of {buf.numel()} bytes")
        crc = crc32(buf.cpu()) if checksum is not None else None
        if checksum is not None and crc != checksum:
            raise UpdateFailed(f"bucket {index}: checksum mismatch (got {crc}, header says {checksum})")
        with self._lock:
            if self._update is u:
                u.received[index], u.crc[index] = True, crc
                if checksum is not None:
                    u.expect(index, checksum)
                u.deadline = time.monotonic() + u.timeout_s

    def verify(self, version: int, checksums: list[int | None] | None = None) -> None:
        """Commit, phase 1: wait for the data, check completeness and checksums (else abort)."""
        with self._lock:
            u = self._current(version, "receiving")
            if u.writing:
                raise UpdateConflict(f"buckets {sorted(u.writing)} are still being written")
            u.phase = "verifying"  # the stale-update timer leaves it alone from now on
        try:
            if u.transport == "dist":
                self._wait_dist(u)
            self._verify_data(u, checksums)
        except UpdateFailed as e:
            with self._lock:
                self._drop(u, str(e))
            raise
        with self._lock:
            if self._update is not u:  # aborted or timed out meanwhile
                raise UpdateFailed(f"update {version} was aborted: {self.last_failure}")
            u.phase = "verified"
            u.named = u.views()

    def _wait_dist(self, u: StagedUpdate) -> None:
        while not u.done.wait(0.05):
            if time.monotonic() > u.deadline:  # the receive thread extends it per bucket
                raise UpdateFailed(f"dist data did not arrive within {u.timeout_s:g}s")

    def _verify_data(self, u: StagedUpdate, checksums: list[int | None] | None) -> None:
        if u.error is not None:
            raise UpdateFailed(f"dist receive failed: {u.error}")
        if self._update is not u:
            raise UpdateFailed(f"aborted meanwhile ({self.last_failure})")
        u.verify(checksums)

    def apply(self, version: int) -> None:
        """Commit, phase 2 (engine paused): apply_fn(named views), then bump the version."""
        with self._lock:
            u = self._current(version, "verified")
            u.phase = "applying"
        try:
            with self._apply_lock:
                self._apply_fn(u.named)
        except Exception as e:
            with self._lock:
                self._drop(u, f"apply failed: {e}")
            raise UpdateFailed(f"update {version}: apply failed: {e}") from e
        with self._lock:
            self._version = version
            self._drop(u, None)

    def commit(self, version: int, checksums: list[int | None] | None = None) -> None:
        self.verify(version, checksums)
        self.apply(version)

    def abort(self, version: int | None = None, reason: str = "aborted by the sender", force: bool = False) -> bool:
        """Drop the update in progress (any version when `version` is None); False if none."""
        with self._lock:
            u = self._update
            if u is None or (version is not None and version != u.version):
                return False
            if u.phase == "applying" or (u.phase == "verified" and not force):
                raise UpdateConflict(f"update {u.version} is {u.phase}; it can no longer be aborted")
            self._drop(u, reason)
            return True

    def close(self) -> None:
        with self._lock:
            if self._update is not None:
                self._drop(self._update, "receiver closed")
            self._shm.close()
            self._dist.close()
            self._staging_cache = None
        self._pool.shutdown(wait=False)
