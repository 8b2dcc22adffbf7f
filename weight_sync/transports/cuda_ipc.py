"""Same-node GPU data plane: one device region the trainer packs and shares ONCE by CUDA IPC handle.

Sender (trainer):                                   Receiver (server):
    region = IpcRegion(run_id="tiny-rl")                reader = IpcReader()
    opts = region.prepare(manifest, device)  # connect  srcs = reader.buckets(opts, manifest, device)
    region.clear_ready()                     # begin    # a thread copies each ready bucket device to
    buf = region.bucket(i, nbytes)           # pack     #   device into private staging on the model's
    region.beat()                            # tensor   #   GPU and hashes it there (mlh64) while the
    region.mark_ready(i, version)            # bucket   #   sender packs the next
    region.close()                                      reader.ready(i) == version; reader.close()

The region is one allocation sized to the whole update, made at connect, reused across
updates and re-created only when the model grows (a new handle, so a new connect). Its
handle travels in the JSON options, base64, never pickled: torch's own
`UntypedStorage._share_cuda_()` fields, opened by the server with `_new_shared_cuda(...)`
once and cached by handle. Readiness and the lease work as for shm: a small host
shared-memory header (`dlrl_ws_*`, weight_sync/transports/shm.py: magic, heartbeat bumped
per packed tensor, one ready stamp per bucket; swept like shm regions) -- the sender stamps a
bucket after its bytes are on the device (the checksum's host sync orders them). The server
never applies from the region: it copies into private staging, verifies there (checksums
computed on the GPU: weight_sync/devhash.py), then applies through the usual path.

Handle kinds (`options.kind`): "cuda" (the real IPC handle; the server's model must be on
CUDA) and "cpu": the same protocol over torch's cross-process CPU storage sharing
(`_share_filename_cpu_` / `_new_shared_filename_cpu`, a `/dev/shm/torch_*` file), for a
trainer and server on CPU. The CPU kind exists so the protocol runs in CPU tests and CPU
benchmarks; a sender uses it only when asked (`allow_cpu=True`, `train.sync_ipc_allow_cpu`).
Every option is hostile until checked (ManifestError naming the field, HTTP 400): the kind
must be one the server's device opens, the base64 must decode, the sizes must fit the
shared file (cpu) or the IPC allocation (cuda, via the driver's cuMemGetAddressRange).
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import logging
import os
import re
import stat
from typing import Any

import torch

from weight_sync.errors import ManifestError, WeightSyncError
from weight_sync.manifest import ALIGN, Manifest
from weight_sync.transports.shm import SHM_DIR, BucketRegion, ShmReader, ShmRegion

log = logging.getLogger("dlrl.weight_sync")
KINDS = ("cuda", "cpu")
TORCH_SHM_NAME = re.compile(rb"^/torch_[0-9]+_[0-9]+_[0-9]+$")  # torch's NewProcessWideShmHandle names
MAX_HANDLE_B64 = 4096


def region_offsets(manifest: Manifest) -> tuple[list[int], int]:
    """Byte offset of each bucket in the device region (aligned), and the region's size."""
    offsets, pos = [], 0
    for b in manifest.buckets:
        offsets.append(pos)
        pos += (b.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, max(pos, ALIGN)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(options: dict[str, Any], key: str, optional: bool = False) -> bytes | None:
    value = options.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_HANDLE_B64:
        raise ManifestError(f"options.{key}: expected a base64 string of at most {MAX_HANDLE_B64} characters")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ManifestError(f"options.{key}: not valid base64") from None


def _int(options: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = options.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value >= 1 << 62:
        raise ManifestError(f"options.{key}: expected an integer >= {minimum}, got {value!r}")
    return value


# ---------------------------------------------------------------------- sender
class IpcRegion(BucketRegion):
    """Sender side: allocates the region (once, zeroed), shares it once, grows it, frees it at close."""

    def __init__(self, run_id: str = "", allow_cpu: bool = False):
        super().__init__()  # data: [size] uint8 over the shared storage
        self.allow_cpu = allow_cpu
        self.header = ShmRegion(run_id)
        self.handle: dict[str, Any] = {}  # what a receiver needs to open it (JSON-safe)

    def prepare(self, manifest: Manifest, device: torch.device) -> dict[str, Any]:
        """Make sure the region fits `manifest` on `device`; return the options receivers need."""
        if device.type != "cuda" and not self.allow_cpu:
            raise WeightSyncError(f"transport cuda_ipc: the trainer's weights are on {device}, not on CUDA "
                                  "(use shm, or allow the CPU kind for tests: train.sync_ipc_allow_cpu=true)")
        self.offsets, size = region_offsets(manifest)
        if self.data is None or self.data.numel() < size or self.data.device != device:
            self._allocate(size, device)
        name = self.header.prepare_header(len(manifest.buckets))
        return {**self.handle, "offsets": self.offsets, "header": name}

    def _allocate(self, size: int, device: torch.device) -> None:
        self.data, self.handle = None, {}
        if device.type == "cuda":
            data = torch.zeros(size, dtype=torch.uint8, device=device)
            dev, handle, nbytes, offset, ref, ref_offset, event, event_sync = data.untyped_storage()._share_cuda_()
            self.handle = {"kind": "cuda", "device": int(dev), "handle": _b64(handle), "size": int(nbytes),
                           "storage_offset": int(offset), "ref_counter": _b64(ref),
                           "ref_counter_offset": int(ref_offset), "event": _b64(event) if event else None,
                           "event_sync": bool(event_sync)}
        else:
            storage = torch.UntypedStorage(size)
            manager, handle, nbytes = storage._share_filename_cpu_()
            data = torch.empty(0, dtype=torch.uint8).set_(storage)
            data.zero_()  # fault the pages in now, not during the first push
            self.handle = {"kind": "cpu", "manager": _b64(manager), "handle": _b64(handle), "size": int(nbytes)}
        self.data = data

    def beat(self) -> None:
        self.header.beat()

    def clear_ready(self) -> None:
        self.header.clear_ready()

    def mark_ready(self, index: int, version: int) -> None:
        """Bucket `index` is packed: its bytes are on the device before the stamp is."""
        if self.data is not None and self.data.is_cuda:
            torch.cuda.current_stream(self.data.device).synchronize()
        self.header.mark_ready(index, version)

    def close(self) -> None:
        self.data, self.handle = None, {}
        self.header.close()


# ---------------------------------------------------------------------- receiver
def _check_cpu(options: dict[str, Any], size: int) -> tuple[bytes, bytes]:
    manager, handle = _unb64(options, "manager"), _unb64(options, "handle")
    assert manager is not None and handle is not None
    if not TORCH_SHM_NAME.match(handle):
        raise ManifestError("options.handle: not a torch shared-memory file name (/torch_<pid>_<n>_<n>)")
    try:
        st = os.stat(SHM_DIR / handle.decode().lstrip("/"))
    except OSError:
        raise ManifestError(f"options.handle: shared file {handle.decode()!r} does not exist on this host") from None
    if st.st_size < size:
        raise ManifestError(f"options.size: {size} bytes, but the shared file has {st.st_size}")
    path = manager.decode(errors="replace")
    if manager and (not path.startswith("/") or not path.endswith("/manager.sock")
                    or not os.path.exists(path) or not stat.S_ISSOCK(os.stat(path).st_mode)):
        raise ManifestError("options.manager: not torch's shared-memory manager socket on this host")
    return manager, handle


def _check_cuda(options: dict[str, Any]) -> None:
    _unb64(options, "handle")
    ref = _unb64(options, "ref_counter")
    assert ref is not None
    if not TORCH_SHM_NAME.match(ref):
        raise ManifestError("options.ref_counter: not a torch shared-memory file name (/torch_<pid>_<n>_<n>)")
    _int(options, "ref_counter_offset")
    _int(options, "storage_offset")
    _unb64(options, "event", optional=True)
    if not isinstance(options.get("event_sync", False), bool):
        raise ManifestError("options.event_sync: expected true or false")
    dev = _int(options, "device")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev >= count:
        raise ManifestError(f"options.device: CUDA device {dev}, but this server sees {count}")


def _allocation_end(ptr: int) -> int | None:
    """End address of the CUDA allocation holding `ptr` (driver API), or None when it cannot be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
            return None
        return base.value + size.value
    except (OSError, AttributeError):
        return None


class IpcReader:
    """Receiver side: opens the sender's region by handle (cached), attaches its header, never frees it."""

    def __init__(self) -> None:
        self.header = ShmReader()
        self.data: torch.Tensor | None = None
        self._key: tuple | None = None  # the options that opened `data`

    @staticmethod
    def check(options: dict[str, Any], manifest: Manifest, device: torch.device) -> None:
        """Every option well-formed and openable by this server's `device` (no side effect)."""
        kind = options.get("kind")
        if kind not in KINDS:
            raise ManifestError(f"options.kind: expected one of {list(KINDS)}, got {kind!r}")
        if kind != device.type:
            can = f"it opens only {device.type!r} regions" if device.type in KINDS else "it opens no IPC region"
            raise ManifestError(f"options.kind: a {kind!r} region, but this server's model is on {device}: {can} "
                                "(use the shm transport)")
        size = _int(options, "size", 1)
        offsets = options.get("offsets")
        if not isinstance(offsets, list) or len(offsets) != len(manifest.buckets):
            raise ManifestError(f"options.offsets: expected one offset per bucket ({len(manifest.buckets)})")
        for i, (off, b) in enumerate(zip(offsets, manifest.buckets)):
            if isinstance(off, bool) or not isinstance(off, int) or off < 0 or off % ALIGN or off + b.nbytes > size:
                raise ManifestError(f"options.offsets[{i}]: bucket of {b.nbytes} bytes does not fit at {off!r} in "
                                    f"a region of {size} bytes (offsets are multiples of {ALIGN})")
        ShmReader.check_name(options.get("header"), "options.header")
        if kind == "cpu":
            _check_cpu(options, size)
        else:
            _check_cuda(options)

    def _open(self, options: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The region as [size] uint8 (opened once per handle)."""
        key = (options["kind"], options["handle"], options.get("manager"), options.get("storage_offset"),
               options["size"])
        if self._key == key and self.data is not None:
            return self.data
        self.data, self._key = None, None
        if options["kind"] == "cpu":
            manager, handle = _check_cpu(options, options["size"])
            try:
                storage = torch.UntypedStorage._new_shared_filename_cpu(
                    manager, handle, options["size"])
            except RuntimeError as e:
                raise ManifestError(f"options.handle: cannot open the shared CPU region: {e}") from None
        else:
            storage = self._open_cuda(options)
        self.data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        self._key = key
        return self.data

    @staticmethod
    def _open_cuda(options: dict[str, Any]) -> torch.UntypedStorage:
        torch.cuda.init()
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                options["device"], _unb64(options, "handle"), options["size"], options["storage_offset"],
                _unb64(options, "ref_counter"), options["ref_counter_offset"],
                _unb64(options, "event", optional=True) or b"", bool(options.get("event_sync", False)))
        except RuntimeError as e:
            raise ManifestError(f"options.handle: cannot open the CUDA IPC handle on this server: {e}") from None
        end = _allocation_end(storage.data_ptr())
        if end is None:
            log.warning("cuda_ipc: cannot ask the driver for the allocation's size; trusting options.size")
        elif storage.data_ptr() + options["size"] > end:
            raise ManifestError(f"options.size: {options['size']} bytes run past the shared CUDA allocation")
        return storage

    def buckets(self, options: dict[str, Any], manifest: Manifest, device: torch.device) -> list[torch.Tensor]:
        """Views of every bucket of the region (read only by convention): list of [nbytes_i] uint8."""
        self.check(options, manifest, device)
        self.header.header(options["header"], len(manifest.buckets))
        data = self._open(options, device)
        return [data[off : off + b.nbytes] for off, b in zip(options["offsets"], manifest.buckets)]

    def release_if_gone(self) -> bool:
        """Unmap the region once its sender's header is gone (closed, or swept after its death), so a
        finished trainer's memory is not held by the server; True when it released one."""
        shm = self.header.shm
        if self.data is None or shm is None or (SHM_DIR / shm.name.lstrip("/")).exists():
            return False
        self.close()
        return True

    def heartbeat(self) -> int:
        return self.header.heartbeat()

    def ready(self, index: int) -> int:
        return self.header.ready(index)

    def close(self) -> None:
        self.data, self._key = None, None
        self.header.close()
