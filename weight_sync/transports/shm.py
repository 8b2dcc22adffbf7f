"""Same-host data plane: one POSIX shared-memory region the trainer writes and servers read.

Sender (trainer):                                 Receiver (server):
    region = ShmRegion(run_id="tiny-rl")              reader = ShmReader()
    opts = region.prepare(manifest)  # connect/begin  srcs = reader.buckets(opts, manifest)
    region.clear_ready()             # before begin   # a thread copies each ready bucket into
    buf = region.bucket(i, nbytes)   # pack here      #   private staging, hashing while copying,
    region.beat()                    # per tensor     #   while the sender packs the next one
    region.mark_ready(i, version)    # per bucket     reader.ready(i) == version
    region.close()                   # unlinks        reader.close(); sweep()  # dead pushers' regions

Layout: a header (magic, heartbeat counter, one ready stamp per bucket; 4 KiB or more),
then the buckets back to back (64-byte aligned). cuda_ipc uses a header-only region
(`prepare_header` / `ShmReader.header`) for its stamps and heartbeat: its bytes are on the GPU. The region is sized to the whole update,
created once (at connect) with its pages populated up front, reused across updates and
re-created only when the model grows. The receiver never applies from the region: it
copies each bucket into private staging and verifies the copy, so bytes changed in the
region after verification are never applied. The heartbeat, bumped by the sender after
every packed tensor, renews the update's lease.

Names and leaks: `dlrl_ws_<run>_<pid>_<random>`. The creator holds a shared flock on the
segment for its whole life; the kernel drops it when the process dies, however it dies.
`sweep()` (server startup, connect, begin, abort; a sender creating a region) unlinks every `dlrl_ws_*` segment whose flock is
free, so a pusher killed together with its resource tracker leaks nothing for long.
Readers unregister their attachments from Python's resource_tracker (which would unlink
the region when the *server* exits); only the creator (or the sweep) unlinks.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import time
import uuid
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weight_sync.errors import ManifestError
from weight_sync.manifest import ALIGN, Manifest

log = logging.getLogger("dlrl.weight_sync")
PREFIX = "dlrl_ws"
HEADER_BYTES = 4096
MAGIC = int.from_bytes(b"DLRLWS02", "little")
SHM_DIR = Path("/dev/shm")
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux >= 5.14
_CREATED_HERE: set[str] = set()  # regions this process created (and so must not unregister)


def region_name(run_id: str) -> str:
    tag = re.sub(r"[^A-Za-z0-9]", "", run_id)[:24] or "anon"
    return f"{PREFIX}_{tag}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def header_bytes(num_buckets: int) -> int:
    """magic, heartbeat, 6 spare words, then one ready stamp per bucket; whole pages."""
    return max(HEADER_BYTES, (64 + 8 * num_buckets + HEADER_BYTES - 1) // HEADER_BYTES * HEADER_BYTES)


def bucket_offsets(manifest: Manifest) -> tuple[list[int], int]:
    """Byte offset of each bucket in the region (after the header), and the region size."""
    offsets, pos = [], header_bytes(len(manifest.buckets))
    for b in manifest.buckets:
        offsets.append(pos)
        pos += (b.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, pos


def _populate(shm: shared_memory.SharedMemory, advice: int) -> None:
    """Fault every page in now (connect time) rather than during the first push."""
    try:
        shm._mmap.madvise(advice)  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):  # old kernel: touch the pages instead
        data = torch.frombuffer(shm.buf, dtype=torch.uint8)
        if advice == _MADV_POPULATE_WRITE:
            data[:: mmap.PAGESIZE].zero_()
        else:
            int(data[:: mmap.PAGESIZE].sum())
        del data


def attach(name: str) -> shared_memory.SharedMemory:
    """Open an existing region without letting this process's resource_tracker own it."""
    shm = Segment(name=name, create=False)
    if name not in _CREATED_HERE:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


class Segment(shared_memory.SharedMemory):
    """A POSIX shared-memory segment whose close never unmaps memory a live view still reads: with a view
    alive (another thread's read) the view owns the mapping, which goes with the last view (`mapped`)."""

    def close(self) -> None:
        try:
            super().close()
        except BufferError:
            self._buf = self._mmap = None
            fd: int = self._fd  # type: ignore[has-type]
            if fd >= 0:
                os.close(fd)
                self._fd = -1


def mapped(shm: shared_memory.SharedMemory) -> torch.Tensor:
    """The segment as [size] uint8. The tensor holds a buffer export of the mapping (through numpy; a plain
    torch.frombuffer holds none), so closing the segment cannot unmap it under a view (`Segment.close`)."""
    assert shm.buf is not None
    return torch.from_numpy(np.frombuffer(shm.buf, dtype=np.uint8))


def _release(shm: shared_memory.SharedMemory | None, unlink: bool) -> None:
    if shm is None:
        return
    shm.close()
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        _CREATED_HERE.discard(shm.name)


def sweep(grace_s: float = 2.0) -> list[str]:
    """Unlink `dlrl_ws_*` segments whose creator is gone (its flock is free); returns their names."""
    removed: list[str] = []
    if not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.glob(f"{PREFIX}_*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_ctime < grace_s:
                continue  # just created: its creator may not hold the lock yet
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: the creator is alive
        finally:
            os.close(fd)
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    if removed:
        log.info("swept %d shared-memory region(s) of dead pushers: %s", len(removed), removed[:5])
    return removed


class BucketRegion:
    """A sender's region: `data` ([size] uint8, None before prepare) holds bucket i from `offsets[i]`."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.offsets: list[int] = []

    def bucket(self, index: int, nbytes: int) -> torch.Tensor:
        """Writable view of bucket `index`: [nbytes] uint8 on the region's device."""
        assert self.data is not None, "prepare() first"
        start = self.offsets[index]
        return self.data[start : start + nbytes]


class ShmRegion(BucketRegion):
    """Sender side: creates (once, populated), caches, grows and finally unlinks the region."""

    def __init__(self, run_id: str = ""):
        super().__init__()  # data: [size] uint8 view of the whole region
        self.run_id = run_id
        self.shm: shared_memory.SharedMemory | None = None
        self.header: torch.Tensor | None = None  # [header_bytes / 8] int64: magic, heartbeat, ..., stamps

    def prepare(self, manifest: Manifest) -> dict[str, Any]:
        """Make sure the region fits `manifest`; return the options receivers need."""
        self.offsets, size = bucket_offsets(manifest)
        shm = self._ensure(size)
        return {"name": shm.name, "size": shm.size, "offsets": self.offsets}

    def prepare_header(self, num_buckets: int) -> str:
        """A region holding only the header (cuda_ipc keeps the bytes on the GPU); returns its name."""
        size = header_bytes(num_buckets)
        self.offsets = [size]
        return self._ensure(size).name

    def _ensure(self, size: int) -> shared_memory.SharedMemory:
        """Create the region (populated) unless the current one holds `size` bytes; write the magic."""
        if self.shm is None or self.shm.size < size:
            self.close()
            sweep()  # regions of earlier pushers on this host that died with their resource tracker
            shm = Segment(name=region_name(self.run_id), create=True, size=size)
            _CREATED_HERE.add(shm.name)
            fcntl.flock(shm._fd, fcntl.LOCK_SH)  # "alive" marker for sweep()
            _populate(shm, _MADV_POPULATE_WRITE)
            self.shm, self.data = shm, mapped(shm)
        assert self.data is not None
        self.header = self.data[: self.offsets[0]].view(torch.int64)
        self.header[0] = MAGIC
        return self.shm

    def beat(self) -> None:
        """Progress marker: the receiver renews the update's lease when it changes."""
        if self.header is not None:
            self.header[1] += 1

    def clear_ready(self) -> None:
        """Before begin: no bucket of the coming update is ready (stamps may hold an aborted try's)."""
        if self.header is not None:
            self.header[8:].zero_()

    def mark_ready(self, index: int, version: int) -> None:
        """Bucket `index` of update `version` is packed (stored after its bytes: x86 keeps the order)."""
        if self.header is not None:
            self.header[8 + index] = version

    def close(self) -> None:
        self.data = self.header = None
        shm, self.shm = self.shm, None
        _release(shm, unlink=True)


class ShmReader:
    """Receiver side: attaches to the sender's region (cached by name), never unlinks it."""

    def __init__(self) -> None:
        self.shm: shared_memory.SharedMemory | None = None
        self.data: torch.Tensor | None = None
        self.stamps: torch.Tensor | None = None

    @staticmethod
    def check(options: dict[str, Any], manifest: Manifest) -> None:
        """The options name an existing weight-sync region with one offset per bucket (no side effect)."""
        name, offsets = options.get("name"), options.get("offsets")
        if not isinstance(name, str) or not isinstance(offsets, list) or len(offsets) != len(manifest.buckets):
            raise ManifestError("options: shm transport needs 'name' and one 'offsets' entry per bucket")
        ShmReader.check_name(name, "options.name")

    @staticmethod
    def check_name(name: Any, field: str) -> None:
        """`name` is an existing `dlrl_ws_*` segment (ManifestError naming `field`)."""
        if not isinstance(name, str):
            raise ManifestError(f"{field}: expected the name of a weight-sync region, got {name!r}")
        if not name.lstrip("/").startswith(PREFIX + "_") or "/" in name.lstrip("/"):
            raise ManifestError(f"{field}: {name!r} is not a weight-sync region ({PREFIX}_*)")
        if SHM_DIR.is_dir() and not (SHM_DIR / name.lstrip("/")).exists():
            raise ManifestError(f"{field}: shared-memory region {name!r} does not exist")

    def _attach(self, name: str, field: str) -> shared_memory.SharedMemory:
        """Attach `name` (cached) and check its magic."""
        if self.shm is None or self.shm.name.lstrip("/") != name.lstrip("/"):
            self.close()
            try:
                shm = attach(name)
            except FileNotFoundError:
                raise ManifestError(f"{field}: shared-memory region {name!r} does not exist") from None
            _populate(shm, _MADV_POPULATE_READ)
            self.shm, self.data = shm, mapped(shm)
        assert self.data is not None
        if self.shm.size < HEADER_BYTES or int(self.data[:8].view(torch.int64)[0]) != MAGIC:
            raise ManifestError(f"{field}: region {name!r} has no weight-sync header")
        return self.shm

    def header(self, name: str, num_buckets: int, field: str = "options.header") -> None:
        """Attach a header-only region (cuda_ipc): its heartbeat and one ready stamp per bucket."""
        self.check_name(name, field)
        shm = self._attach(name, field)
        if shm.size < header_bytes(num_buckets):
            raise ManifestError(f"{field}: region {name!r} has no room for {num_buckets} ready stamps")
        assert self.data is not None
        self.stamps = self.data[64 : 64 + 8 * num_buckets].view(torch.int64)

    def buckets(self, options: dict[str, Any], manifest: Manifest) -> list[torch.Tensor]:
        """Views of every bucket in the region (read only by convention): list of [nbytes_i] uint8."""
        self.check(options, manifest)
        name, size, offsets = options["name"], options.get("size"), options["offsets"]
        shm = self._attach(name, "options.name")
        assert self.data is not None
        if not offsets or not isinstance(offsets[0], int) or offsets[0] < header_bytes(len(offsets)) \
                or offsets[0] % 8:
            raise ManifestError(f"options.offsets[0]: leaves no room for the header of {len(offsets)} buckets")
        self.stamps = self.data[64 : 64 + 8 * len(offsets)].view(torch.int64)  # [num_buckets]
        if isinstance(size, int) and shm.size < size:
            raise ManifestError(f"options.size: region {name!r} has {shm.size} bytes, sender says {size}")
        views = []
        for i, (off, b) in enumerate(zip(offsets, manifest.buckets)):
            if not isinstance(off, int) or off < offsets[0] or off + b.nbytes > shm.size:
                raise ManifestError(f"options.offsets[{i}]: bucket does not fit in region {name!r}")
            views.append(self.data[off : off + b.nbytes])
        return views

    def heartbeat(self) -> int:
        data = self.data  # one read: close() may run on another thread
        return int(data[8:16].view(torch.int64)[0]) if data is not None else 0

    def ready(self, index: int) -> int:
        """The version whose bucket `index` the sender has packed (0: none)."""
        stamps = self.stamps
        return int(stamps[index]) if stamps is not None and index < stamps.numel() else 0

    def close(self) -> None:
        self.data = self.stamps = None
        shm, self.shm = self.shm, None
        _release(shm, unlink=False)
