"""Same-host data plane: one POSIX shared-memory region the trainer writes and servers read.

Sender (trainer):                                 Receiver (server):
    region = ShmRegion()                              reader = ShmReader()
    opts = region.prepare(manifest)  # -> begin       bufs = reader.buckets(opts, manifest)
    buf = region.bucket(i)           # write here     # verify + apply straight from bufs
    region.close()                   # unlinks        reader.close()

The region is sized to the whole update (buckets laid out back to back, 64-byte aligned),
so the trainer writes every bucket once and any number of servers on the host read it:
the receiver verifies and applies directly from the region, with no staging copy. The
sender keeps the region open across updates and re-creates it only when it must grow.

Ownership: only the creator unlinks. Python's resource_tracker registers every attach
(Python < 3.13 has no `track=False`) and would unlink the region when the *server*
exits, so the reader unregisters its attachments; the creator's registration stays, so
a crashed trainer still gets its region cleaned up.
"""

from __future__ import annotations

import os
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from weight_sync.errors import ManifestError
from weight_sync.manifest import ALIGN, Manifest

_CREATED_HERE: set[str] = set()  # regions this process created (and so must not unregister)


def bucket_offsets(manifest: Manifest) -> tuple[list[int], int]:
    """Byte offset of each bucket in the region, and the region size."""
    offsets, pos = [], 0
    for b in manifest.buckets:
        offsets.append(pos)
        pos += (b.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, max(pos, ALIGN)


def attach(name: str) -> shared_memory.SharedMemory:
    """Open an existing region without letting this process's resource_tracker own it."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    if name not in _CREATED_HERE:
        resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def _release(shm: shared_memory.SharedMemory | None, unlink: bool) -> None:
    if shm is None:
        return
    try:
        shm.close()
    except BufferError:  # a tensor view is still alive; the mapping goes when it is collected
        pass
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        _CREATED_HERE.discard(shm.name)


class ShmRegion:
    """Sender side: creates, caches and finally unlinks the region."""

    def __init__(self, prefix: str = "dlrl_ws"):
        self.prefix = prefix
        self.shm: shared_memory.SharedMemory | None = None
        self.data: torch.Tensor | None = None  # [size] uint8 view of the whole region
        self.offsets: list[int] = []

    def prepare(self, manifest: Manifest) -> dict[str, Any]:
        """Make sure the region fits `manifest`; return the begin options for receivers."""
        self.offsets, size = bucket_offsets(manifest)
        if self.shm is None or self.shm.size < size:
            self.close()
            name = f"{self.prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            _CREATED_HERE.add(self.shm.name)
            self.data = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        return {"name": self.shm.name, "size": self.shm.size, "offsets": self.offsets}

    def bucket(self, index: int, nbytes: int) -> torch.Tensor:
        """Writable view of bucket `index`: [nbytes] uint8."""
        assert self.data is not None, "prepare() first"
        start = self.offsets[index]
        return self.data[start : start + nbytes]

    def close(self) -> None:
        self.data = None
        shm, self.shm = self.shm, None
        _release(shm, unlink=True)


class ShmReader:
    """Receiver side: attaches to the sender's region (cached by name), never unlinks it."""

    def __init__(self) -> None:
        self.shm: shared_memory.SharedMemory | None = None
        self.data: torch.Tensor | None = None

    def buckets(self, options: dict[str, Any], manifest: Manifest) -> list[torch.Tensor]:
        """Read-only-by-convention views of every bucket: list of [nbytes_i] uint8."""
        name, size, offsets = options.get("name"), options.get("size"), options.get("offsets")
        if not isinstance(name, str) or not isinstance(offsets, list) or len(offsets) != len(manifest.buckets):
            raise ManifestError("options: shm transport needs 'name' and one 'offsets' entry per bucket")
        if self.shm is None or self.shm.name.lstrip("/") != name.lstrip("/"):
            self.close()
            try:
                self.shm = attach(name)
            except FileNotFoundError:
                raise ManifestError(f"options.name: shared-memory region {name!r} does not exist") from None
            self.data = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        assert self.data is not None
        if isinstance(size, int) and self.shm.size < size:
            raise ManifestError(f"options.size: region {name!r} has {self.shm.size} bytes, sender says {size}")
        views = []
        for i, (off, b) in enumerate(zip(offsets, manifest.buckets)):
            if not isinstance(off, int) or off < 0 or off + b.nbytes > self.shm.size:
                raise ManifestError(f"options.offsets[{i}]: bucket does not fit in region {name!r}")
            views.append(self.data[off : off + b.nbytes])
        return views

    def close(self) -> None:
        self.data = None
        shm, self.shm = self.shm, None
        _release(shm, unlink=False)
