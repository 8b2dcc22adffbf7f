"""One staged (received, not yet applied) weight update: its lease, its buckets, its verification.

    u = StagedUpdate(version, "http", manifest, staging, lease_s=30, run_id="tiny-rl")
    u.scan(i, check_finite=True)      # hash bucket i (copying it from u.sources[i] first for shm)
    u.expect(2, checksum_from_header) # expected checksums from manifest / header / commit
    u.verify(commit_checksums, True)  # complete? every checksum equal? every tensor finite?
    named = u.views()                 # [(name, typed view into private staging)] for apply_fn
    pool = StagingPool(keep=True); pool.get(device, manifest)   # buffers reused across updates
    outcomes = Outcomes(); outcomes.record(7, UpdatePhase.APPLIED, run_id="r"); outcomes.get(7)

Every byte that gets applied is hashed where it will be applied from: the private staging
(dist and http receive into it; shm copies the region into it while hashing, chunk by
chunk; cuda_ipc copies device to device, then hashes on the device: weight_sync/devhash.py). Floating tensors are checked for NaN/inf in the same pass. Used by
weight_sync.receiver, which owns the locking and the state machine.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any

import torch

from weight_sync.bucket import pieces, unpack
from weight_sync.checksum import Hasher, scan
from weight_sync.devhash import ALGO as DEVICE_ALGO
from weight_sync.devhash import device_scan
from weight_sync.errors import NonFiniteWeights, UpdateFailed
from weight_sync.manifest import ALIGN, Manifest
from weight_sync.protocol import UpdatePhase


@dataclasses.dataclass(eq=False)
class StagedUpdate:
    version: int
    transport: str
    manifest: Manifest
    staging: list[torch.Tensor]  # one private [nbytes_i] uint8 tensor per bucket
    lease_s: float
    run_id: str = ""
    sources: list[torch.Tensor] | None = None  # shm / cuda_ipc: the region's buckets, copied as they are ready
    phase: UpdatePhase = UpdatePhase.RECEIVING  # receiving | verifying | verified | draining | applying
    deadline: float = 0.0  # monotonic; data-plane progress pushes it back by lease_s
    received: list[bool] = dataclasses.field(default_factory=list)
    digests: list[int | None] = dataclasses.field(default_factory=list)  # of the staged bytes
    expected: list[int | None] = dataclasses.field(default_factory=list)  # manifest / header / commit
    nonfinite: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    writing: set[int] = dataclasses.field(default_factory=set)  # http buckets being streamed in
    pending: dict[int, Future] = dataclasses.field(default_factory=dict)  # scans running as buckets land
    error: BaseException | None = None  # dist receive error
    heartbeat: int = 0  # last shm heartbeat seen
    done: threading.Event = dataclasses.field(default_factory=threading.Event)  # data plane finished
    staged: threading.Event = dataclasses.field(default_factory=threading.Event)  # shm staging thread ended
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)  # tells data threads to quit
    named: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.staging)
        self.received = self.received or [self.sources is not None] * n
        self.digests = self.digests or [None] * n
        self.expected = self.expected or [b.checksum for b in self.manifest.buckets]
        self.renew()

    def renew(self) -> None:
        self.deadline = time.monotonic() + self.lease_s

    def lease_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic()) if self.phase is UpdatePhase.RECEIVING else self.lease_s

    def expect(self, index: int, checksum: int) -> None:
        """Record the expected checksum of bucket `index`; two different claims are an error."""
        if self.expected[index] is not None and self.expected[index] != checksum:
            raise UpdateFailed(f"bucket {index}: conflicting checksums {self.expected[index]} and {checksum}")
        self.expected[index] = checksum

    def scan(self, index: int, check_finite: bool) -> tuple[int, list[str]]:
        """Hash (and NaN-check) bucket `index` of the staging, copying it in from the region first
        (shm, cuda_ipc). mlh64 manifests are hashed where the staging is (the GPU for cuda_ipc)."""
        src = None if self.sources is None else self.sources[index]
        if self.manifest.checksum_algo == DEVICE_ALGO:
            if src is not None:
                self.staging[index].copy_(src)  # device to device (cuda_ipc), then hashed there
            return device_scan(self.staging[index], pieces(self.manifest, index), check_finite)
        hasher = Hasher()
        bad = scan(self.staging[index], pieces(self.manifest, index), hasher, src=src, check_finite=check_finite)
        return hasher.value(), bad

    def _scan_unless_stopped(self, index: int, check_finite: bool) -> tuple[int, list[str]]:
        if self.stop.is_set():
            raise UpdateFailed("aborted while verifying")
        return self.scan(index, check_finite)

    def record(self, index: int, digest: int, bad: list[str]) -> None:
        self.digests[index] = digest
        if bad:
            self.nonfinite[index] = bad

    def verify(self, checksums: list[int | None] | None, check_finite: bool, pool: Executor | None = None) -> None:
        """Every bucket received and scanned, equal to its expected checksum, every tensor finite.

        Buckets not scanned yet (shm: all of them) are scanned in `pool` (threads: the copy of
        one bucket overlaps the hashing of another) or here.
        """
        missing = [i for i, ok in enumerate(self.received) if not ok]
        if missing:
            raise UpdateFailed(f"incomplete: bucket(s) {missing[:10]} of {len(self.received)} not received")
        n = len(self.staging)
        if checksums is not None and len(checksums) != n:
            raise UpdateFailed(f"checksums: expected {n} values, got {len(checksums)}")
        for i, c in enumerate(checksums or []):
            if c is not None:
                self.expect(i, c)
        unknown = [i for i in range(n) if self.expected[i] is None]
        if unknown:
            raise UpdateFailed(f"no checksum for bucket(s) {unknown[:10]} (manifest, header or commit)")
        todo = [i for i in range(n) if self.digests[i] is None and i not in self.pending]
        if pool is not None:
            self.pending.update({i: pool.submit(self._scan_unless_stopped, i, check_finite) for i in todo})
        else:
            for i in todo:
                self.record(i, *self._scan_unless_stopped(i, check_finite))
        for i, future in list(self.pending.items()):
            self.record(i, *future.result())
        bad = [i for i in range(n) if self.digests[i] != self.expected[i]]
        if bad:
            raise UpdateFailed(f"checksum mismatch in bucket(s) {bad[:10]}: the staged bytes differ from "
                               "what the sender packed")
        names = [name for i in sorted(self.nonfinite) for name in self.nonfinite[i]]
        if names and check_finite:
            raise NonFiniteWeights(f"non-finite values (NaN/inf) in {len(names)} tensor(s): {names[:5]}; nothing "
                                   "was applied (server.weight_sync_check_finite=false allows them)")

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """Typed zero-copy views of every tensor in the private staging, in manifest order."""
        return [nt for i, buf in enumerate(self.staging) for nt in unpack(buf, self.manifest, i)]


class StagingPool:
    """Private per-bucket staging buffers, allocated (pages touched) once per layout and reused."""

    def __init__(self, keep: bool = True):
        self.keep = keep  # False: allocate per update (saves model-size memory between updates)
        self._cached: tuple[tuple, list[torch.Tensor]] | None = None

    def get(self, device: torch.device, m: Manifest) -> list[torch.Tensor]:
        key = (device, tuple(b.nbytes for b in m.buckets))
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        self._cached = None
        offsets, pos = [], 0
        for b in m.buckets:
            offsets.append(pos)
            pos += (b.nbytes + ALIGN - 1) // ALIGN * ALIGN
        try:
            flat = torch.empty(max(pos, 1), dtype=torch.uint8, device=device)
            flat.fill_(0)  # fault the pages in now, not during the push
        except RuntimeError as e:  # out of memory
            raise UpdateFailed(f"cannot allocate {m.total_bytes} staging bytes on {device}: {e}") from None
        staging = [flat[o : o + b.nbytes] for o, b in zip(offsets, m.buckets)]
        if self.keep:
            self._cached = (key, staging)
        return staging

    def invalidate(self) -> None:
        """Never hand the cached buffers out again (a stray writer may still touch them)."""
        self._cached = None


class Outcomes:
    """What became of the most recent versions: {"state": APPLIED | FAILED (UNKNOWN: not here), "reason", "run_id"}."""

    def __init__(self, size: int = 64):
        self.size = size
        self._items: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()

    def record(self, version: int, state: UpdatePhase, reason: str = "", run_id: str = "") -> None:
        self._items[version] = {"state": state, "reason": reason, "run_id": run_id}
        self._items.move_to_end(version)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, version: int) -> dict[str, Any]:
        return dict(self._items.get(version, {"state": UpdatePhase.UNKNOWN, "reason": "", "run_id": ""}))
