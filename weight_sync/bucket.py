"""Pack named tensors into contiguous uint8 buckets, and view them back out without copying.

    manifest = plan_buckets(specs_of(named), bucket_bytes=64 << 20, version=3)
    get = lambda i, n: torch.empty(n, dtype=torch.uint8)
    for index, buf, checksum in pack_stream(manifest, iter(named), get):
        send(index, buf, checksum)            # buf: [manifest.buckets[index].nbytes] uint8
    views = unpack(buf, manifest, index)      # [(name, tensor view of buf)], no copy
    pieces(manifest, index)                   # byte spans of a bucket, for the receiver's scan

A tensor is converted to the serving dtype while it is copied into its bucket, chunk by
chunk, and each chunk is hashed (xxh3_64) right after it lands, while it is in cache: one
pass packs and checksums (weight_sync/checksum.py; a manifest whose checksum_algo is
"mlh64" is packed first, then hashed where the bucket lives: weight_sync/devhash.py). Padding between tensors is zeroed, so
the checksum covers the whole bucket. Tensors larger than `bucket_bytes` get a bucket of
their own. Buckets on a GPU (NCCL) are packed there and hashed from a host copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from weight_sync.checksum import ALGO, Hasher, Piece, checksum, copy_hashed
from weight_sync.devhash import ALGO as DEVICE_ALGO
from weight_sync.devhash import mlh64
from weight_sync.errors import ManifestError
from weight_sync.manifest import ALIGN, DTYPES, BucketInfo, Manifest, TensorEntry, dtype_name

Spec = tuple[str, str, tuple[int, ...]]  # (name, dtype name, shape)
DEFAULT_BUCKET_BYTES = 64 << 20


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def spec_of(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> Spec:
    """(name, dtype, shape) as sent: floating tensors are cast to `dtype` when given."""
    send_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return name, dtype_name(send_dtype), tuple(t.shape)


def specs_of(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> list[Spec]:
    return [spec_of(n, t, dtype) for n, t in named]


def plan_buckets(specs: list[Spec], bucket_bytes: int = DEFAULT_BUCKET_BYTES, version: int = 0,
                 checksum_algo: str = ALGO) -> Manifest:
    """Lay tensors out greedily, in the given order, into buckets of at most `bucket_bytes`."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes: must be >= {ALIGN}, got {bucket_bytes}")
    entries: list[TensorEntry] = []
    sizes: list[int] = []
    fill = 0
    for name, dtype, shape in specs:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * DTYPES[dtype].itemsize
        offset = _align(fill)
        if not sizes or (offset + nbytes > bucket_bytes and fill > 0):
            sizes.append(0)
            offset = 0
        entries.append(TensorEntry(name, dtype, tuple(shape), len(sizes) - 1, offset, nbytes))
        fill = offset + nbytes
        sizes[-1] = fill
    if not entries:
        raise ManifestError("manifest.entries: no tensors to send")
    buckets = [BucketInfo(nbytes=n) for n in sizes]
    return Manifest(version=version, entries=entries, buckets=buckets, total_bytes=sum(sizes),
                    checksum_algo=checksum_algo)


def entry_view(bucket: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """Typed view of entry `e` inside the flat uint8 `bucket` (no copy)."""
    return bucket[e.offset : e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape)


def unpack(bucket: torch.Tensor, manifest: Manifest, index: int) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy typed views of every tensor of bucket `index`."""
    if bucket.numel() != manifest.buckets[index].nbytes:
        raise ManifestError(
            f"bucket {index}: has {bucket.numel()} bytes, manifest says {manifest.buckets[index].nbytes}"
        )
    return [(e.name, entry_view(bucket, e)) for e in manifest.entries if e.bucket == index]


def pieces(manifest: Manifest, index: int) -> list[Piece]:
    """Byte spans tiling bucket `index` in order: (start, end, dtype or None for padding, name)."""
    out: list[Piece] = []
    pos = 0
    for e in sorted((e for e in manifest.entries if e.bucket == index), key=lambda e: e.offset):
        if e.offset > pos:
            out.append((pos, e.offset, None, ""))
        out.append((e.offset, e.offset + e.nbytes, DTYPES[e.dtype], e.name))
        pos = e.offset + e.nbytes
    if pos < manifest.buckets[index].nbytes:
        out.append((pos, manifest.buckets[index].nbytes, None, ""))
    return out


def _fill(buf: torch.Tensor, entries: list[TensorEntry], named: Iterator[tuple[str, torch.Tensor]],
          hasher: Hasher | None, on_tensor: Callable[[], None] | None) -> None:
    """Copy the next tensors of `named` into their places in `buf`, zero the padding, hash in order."""
    pos = 0
    for e in entries:
        try:
            name, t = next(named)
        except StopIteration:
            raise ManifestError(f"tensor source ended before {e.name!r}") from None
        if name != e.name or tuple(t.shape) != e.shape:
            raise ManifestError(
                f"tensor source yielded {name!r} {tuple(t.shape)}, expected {e.name!r} {e.shape} "
                "(the source must yield the same tensors in the same order every time)"
            )
        if e.offset > pos:
            buf[pos : e.offset].zero_()
            if hasher is not None:
                hasher.update(buf[pos : e.offset])
        dst = entry_view(buf, e).view(-1)  # [numel] in the sent dtype
        if hasher is not None:
            copy_hashed(dst, t.detach().reshape(-1), hasher, buf[e.offset : e.offset + e.nbytes])
        else:
            dst.copy_(t.detach().reshape(-1))
        pos = e.offset + e.nbytes
        if on_tensor is not None:
            on_tensor()
    if pos < buf.numel():
        buf[pos:].zero_()
        if hasher is not None:
            hasher.update(buf[pos:])


def pack_stream(
    manifest: Manifest,
    named: Iterator[tuple[str, torch.Tensor]],
    get_buffer: Callable[[int, int], torch.Tensor],
    on_tensor: Callable[[], None] | None = None,
) -> Iterator[tuple[int, torch.Tensor, int]]:
    """Copy tensors (in manifest order) into buckets; yield (index, bucket, checksum) as each fills.

    `get_buffer(index, nbytes)` returns the flat uint8 destination of bucket `index`
    (a slice of a shared-memory region, or a reused staging buffer). The consumer must be
    done with a yielded bucket before asking for the next one when buffers are reused.
    `on_tensor()` is called after each tensor (the shm sender bumps its heartbeat there).
    """
    by_bucket: dict[int, list[TensorEntry]] = {}
    for e in manifest.entries:
        by_bucket.setdefault(e.bucket, []).append(e)
    for index, info in enumerate(manifest.buckets):
        buf = get_buffer(index, info.nbytes)  # [nbytes] uint8
        entries = sorted(by_bucket.get(index, []), key=lambda e: e.offset)
        if manifest.checksum_algo == DEVICE_ALGO:  # pack, then hash where the bucket is (cuda_ipc)
            _fill(buf, entries, named, None, on_tensor)
            yield index, buf, mlh64(buf)  # (its host sync also means the bucket's bytes are written)
        elif buf.device.type == "cpu":
            hasher = Hasher()
            _fill(buf, entries, named, hasher, on_tensor)
            yield index, buf, hasher.value()
        else:  # device bucket (NCCL): pack on the device, hash a host copy
            _fill(buf, entries, named, None, on_tensor)
            yield index, buf, checksum(buf.cpu())
    extra = next(named, None)
    if extra is not None:
        raise ManifestError(f"tensor source yielded an unexpected extra tensor {extra[0]!r}")
