"""Fast integrity checks: xxHash3 (64-bit) of byte buffers, fused with the copy that moves them.

    h = Hasher(); h.update(buf); h.value()        # streaming: equal to checksum(concatenation)
    checksum(buf)                                 # one shot, buf: flat uint8 CPU tensor
    copy_hashed(dst, src, h)                      # dst.copy_(src) chunk by chunk, hashing dst while hot
    scan(buf, pieces, h, check_finite=True)       # hash + finiteness of typed pieces, one pass

Why xxh3_64 (package `xxhash`, which releases the GIL): on this project's 2-core box it
hashes at ~20 GB/s against 10 GB/s for a memcpy (crc32c 15, zlib.crc32 3.7). Hashing a
chunk right after copying it reads it from cache, so a fused copy+hash costs ~1.15 memcpy:
the sender hashes while packing, the receiver while staging -- no separate pass over memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

ALGO = "xxh3_64"
CHUNK_BYTES = 4 << 20  # copy a chunk, then hash (and NaN-check) it while it is still in cache


class Hasher:
    """Streaming xxh3_64 over flat uint8 CPU tensors."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, buf: torch.Tensor) -> None:
        if buf.numel():
            self._h.update(buf.numpy().data)  # the tensor's bytes, not copied

    def value(self) -> int:
        return self._h.intdigest()


def checksum(buf: torch.Tensor) -> int:
    """xxh3_64 of a flat uint8 CPU tensor, without copying it."""
    if not buf.numel():
        return xxhash.xxh3_64_intdigest(b"")
    view = buf.numpy().data  # the tensor's bytes, not copied
    return xxhash.xxh3_64_intdigest(view)


def parallel_checksums(bufs: list[torch.Tensor], num_threads: int = 2) -> list[int]:
    """checksum of each buffer, in threads (xxhash releases the GIL)."""
    if len(bufs) <= 1:
        return [checksum(b) for b in bufs]
    with ThreadPoolExecutor(min(num_threads, len(bufs))) as pool:
        return list(pool.map(checksum, bufs))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` as a flat uint8 CPU tensor (a view when `t` is contiguous on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)  # [numel * itemsize]


def copy_hashed(dst: torch.Tensor, src: torch.Tensor, hasher: Hasher, dst_bytes: torch.Tensor | None = None,
                chunk_bytes: int | None = None) -> None:
    """dst.copy_(src) (converting dtype) in chunks, hashing each chunk of dst right after it lands.

    dst: flat typed CPU tensor (a view into a bucket); src: flat tensor of the same numel on
    any device; dst_bytes: the uint8 view of dst's bytes (default: computed).
    """
    dst_bytes = dst.view(torch.uint8) if dst_bytes is None else dst_bytes
    itemsize = dst.element_size()
    step = max(1, (chunk_bytes or CHUNK_BYTES) // itemsize)
    for start in range(0, dst.numel(), step):
        end = min(start + step, dst.numel())
        dst[start:end].copy_(src[start:end])
        hasher.update(dst_bytes[start * itemsize : end * itemsize])


def is_finite(t: torch.Tensor) -> bool:
    """True when no element of the floating tensor `t` is NaN or infinite (cheap reduction first)."""
    if not t.is_floating_point() or not t.numel():
        return True
    total = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    if bool(torch.isfinite(total)):
        return True  # a NaN/inf element would make the sum non-finite
    return bool(torch.isfinite(t).all())  # the sum overflowed, or a real NaN/inf: check exactly


Piece = tuple[int, int, torch.dtype | None, str]  # (byte start, byte end, dtype to check or None, tensor name)


def scan(buf: torch.Tensor, pieces: Iterable[Piece], hasher: Hasher, src: torch.Tensor | None = None,
         check_finite: bool = True, chunk_bytes: int | None = None) -> list[str]:
    """One pass over bucket `buf` ([nbytes] uint8): optionally copy it from `src` first (chunk by
    chunk), hash every byte in order and check floating pieces for NaN/inf while each chunk is
    in cache. `pieces` must tile [0, nbytes) in order. Returns the names of non-finite tensors.
    """
    bad: list[str] = []
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    for start, end, dtype, name in pieces:
        step = chunk_bytes if dtype is None else max(1, chunk_bytes // dtype.itemsize) * dtype.itemsize
        for a in range(start, end, step):
            b = min(a + step, end)
            if src is not None:
                buf[a:b].copy_(src[a:b])
            hasher.update(buf[a:b])
            if (check_finite and dtype is not None and dtype.is_floating_point and (not bad or bad[-1] != name)
                    and not is_finite(buf[a:b].view(dtype))):
                bad.append(name)
    return bad
