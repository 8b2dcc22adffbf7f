"""KeptVersions: the last K served weight versions, in host memory, for `POST /weights/rollback`.

    kept = KeptVersions(keep=2)
    kept.capture(7, model.hf_named_tensors())     # worker thread, after version 7 is applied
    kept.get(6).tensors                           # {name: host tensor}: what copy_into_model restores
    kept.touch(6)                                 # 6 is served again (it becomes the most recent)

Which versions: the K most recently served ones (the version the server started with counts
as served, a rollback makes its target the most recent again), so a new version evicts the
one served longest ago and its host buffers are reused for the copy (no allocation once K
are held). Each kept version carries `weights_digest` of its tensors (equal to what
`GET /weights/checksum` answered while it was served); a version whose weights are not all
finite is not kept. Memory: K copies of the parameters in host memory (pinned when the model
is on a GPU, so the copies back run at full bandwidth).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from weight_sync import WeightSyncError, weights_digest
from weight_sync.checksum import is_finite

log = logging.getLogger("dlrl.server")


class NotKept(WeightSyncError):
    """A rollback to a version this server does not hold (HTTP 404)."""

    http_status = 404


@dataclass
class Kept:
    version: int
    tensors: dict[str, torch.Tensor]  # name -> host tensor (same dtype and shape as the parameter)
    digest: str
    captured: float                   # unix time

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class KeptVersions:
    def __init__(self, keep: int = 2):
        if keep < 0:
            raise ValueError(f"keep_versions: must be >= 0, got {keep}")
        self.keep = keep
        self._kept: OrderedDict[int, Kept] = OrderedDict()  # least recently served first
        self._lock = threading.Lock()

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._kept)

    def get(self, version: int) -> Kept | None:
        with self._lock:
            return self._kept.get(version)

    def touch(self, version: int) -> None:
        with self._lock:
            if version in self._kept:
                self._kept.move_to_end(version)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(k.num_bytes for k in self._kept.values())

    def _spare_buffers(self, version: int) -> dict[str, torch.Tensor]:
        """Make room for `version`: drop it if held, evict down to K-1 versions; return the
        buffers of the last evicted version for reuse."""
        with self._lock:
            spare = self._kept.pop(version, None)
            while len(self._kept) >= self.keep:
                spare = self._kept.popitem(last=False)[1]
        return spare.tensors if spare is not None else {}

    def capture(self, version: int, named_params: Iterable[tuple[str, torch.Tensor]]) -> Kept | None:
        """Copy the parameters into host memory as `version` (the caller keeps them unchanged
        meanwhile). Returns the kept entry, or None (keep=0, or weights not finite)."""
        if self.keep == 0:
            return None
        t0 = time.perf_counter()
        params = list(named_params)
        spare = self._spare_buffers(version)
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in params:
                buf = spare.get(name)
                if buf is None or buf.shape != p.shape or buf.dtype != p.dtype:
                    buf = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda)
                buf.copy_(p.detach())
                tensors[name] = buf
        bad = [name for name, t in tensors.items() if not is_finite(t)]
        if bad:
            log.warning("version %d not kept for rollback: non-finite values in %s", version, bad[0])
            return None
        kept = Kept(version, tensors, weights_digest(tensors), time.time())
        with self._lock:
            self._kept[version] = kept
        log.info("kept version %d for rollback (%.1f MB, %.3fs); kept: %s", version, kept.num_bytes / 1e6,
                 time.perf_counter() - t0, self.versions())
        return kept

    def verified(self, version: int) -> Kept:
        """The kept version after re-checking its digest (host memory unchanged since capture);
        NotKept when not kept, ValueError when the check fails."""
        kept = self.get(version)
        if kept is None:
            raise NotKept(f"version: {version} is not kept here (kept: {self.versions()})")
        if weights_digest(kept.tensors) != kept.digest:
            raise ValueError(f"kept version {version} no longer matches its digest; not restored")
        return kept
