"""The state of one staged (received but not yet applied) weight update, and its verification.

    u = StagedUpdate(version, "http", manifest, staging, timeout_s, deadline, ...)
    u.expect(2, crc_from_header)      # expected checksums from manifest / header / commit
    u.verify(commit_checksums)        # complete? every bucket's crc32 matches? else UpdateFailed
    named = u.views()                 # [(name, typed view into staging)] for apply_fn

Used by weight_sync.receiver, which owns the locking and the state machine
(receiving -> verifying -> verified -> applying).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import torch

from weight_sync.bucket import unpack
from weight_sync.errors import UpdateFailed
from weight_sync.manifest import Manifest, parallel_crc32


@dataclasses.dataclass(eq=False)
class StagedUpdate:
    version: int
    transport: str
    manifest: Manifest
    staging: list[torch.Tensor]  # one [nbytes_i] uint8 tensor per bucket
    timeout_s: float
    deadline: float  # monotonic time; progress pushes it back by timeout_s
    phase: str = "receiving"  # receiving | verifying | verified | applying
    received: list[bool] = dataclasses.field(default_factory=list)
    crc: list[int | None] = dataclasses.field(default_factory=list)  # crc of the staged bytes, once computed
    expected: list[int | None] = dataclasses.field(default_factory=list)  # from manifest / header / commit
    writing: set[int] = dataclasses.field(default_factory=set)  # http buckets being streamed in
    pending: dict[int, Future] = dataclasses.field(default_factory=dict)  # crc computed as buckets land
    error: BaseException | None = None  # dist receive error
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    named: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)

    def expect(self, index: int, checksum: int) -> None:
        """Record the expected crc32 of bucket `index`; two different claims are an error."""
        if self.expected[index] is not None and self.expected[index] != checksum:
            raise UpdateFailed(f"bucket {index}: conflicting checksums {self.expected[index]} and {checksum}")
        self.expected[index] = checksum

    def verify(self, checksums: list[int | None] | None) -> None:
        """Every bucket received, and its crc32 equal to the expected one; else UpdateFailed."""
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
        for i, future in self.pending.items():
            self.crc[i] = future.result()
        todo = [i for i in range(n) if self.crc[i] is None]
        for i, crc in zip(todo, parallel_crc32([self.staging[i].cpu() for i in todo])):
            self.crc[i] = crc
        bad = [i for i in range(n) if self.crc[i] != self.expected[i]]
        if bad:
            raise UpdateFailed(f"checksum mismatch in bucket(s) {bad[:10]}")

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """Typed zero-copy views of every tensor, in manifest order."""
        return [nt for i, buf in enumerate(self.staging) for nt in unpack(buf, self.manifest, i)]
