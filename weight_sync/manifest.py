"""The JSON manifest of a weight update, checksums, and the digest of a set of named tensors.

    m = Manifest(version=3, entries=[...], buckets=[...], total_bytes=...)
    m2 = Manifest.from_json(m.to_json())      # validates; ValueError (ManifestError) names the field
    weights_digest(model.hf_named_tensors())  # same string on trainer and server <=> same weights

A manifest lists every tensor of the update: name, dtype (e.g. "bfloat16"), shape, the
bucket it lives in, its byte offset inside that bucket, and its nbytes. Each bucket has
its nbytes and the checksum of its bytes, padding included (the sender zeroes the
padding; None until the sender has packed it: a streaming sender sends checksums at
commit). `checksum_algo` names the checksum: "xxh3_64" (the default, computed on the host)
or "mlh64" (computed where the bytes are, e.g. on the GPU: weight_sync/devhash.py). Offsets are aligned to `ALIGN` bytes so that a byte view can be re-viewed as any
dtype without a copy. Nothing is pickled. Checksums: weight_sync/checksum.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch

from weight_sync.checksum import ALGO, as_bytes, parallel_checksums
from weight_sync.devhash import ALGO as DEVICE_ALGO
from weight_sync.errors import ManifestError

ALIGN = 64  # byte alignment of every tensor inside a bucket
FORMAT = 2  # 2: checksums over whole buckets (padding zeroed)
CHECKSUM_ALGOS = (ALGO, DEVICE_ALGO)  # xxh3_64 (host, the default) | mlh64 (computed on the device: cuda_ipc)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ManifestError(f"dtype: unsupported dtype {name!r} (supported: {sorted(DTYPES)})")
    return name


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> str:
    """Digest of tensors sorted by name, over name, dtype, shape and raw bytes (xxh3_64 each).

    The trainer and the server (`GET /weights/checksum`) compute it the same way; equal
    digests mean identical weights (up to collisions of deliberately forged data).
    """
    items = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    names = sorted(items)
    crcs = parallel_checksums([as_bytes(items[n]) for n in names])
    h = hashlib.blake2b(digest_size=16)
    for name, crc in zip(names, crcs):
        t = items[name]
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|{crc:016x}\n".encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int


@dataclasses.dataclass
class BucketInfo:
    nbytes: int
    checksum: int | None = None  # checksum_algo of the bucket's bytes; None = sent at commit


@dataclasses.dataclass
class Manifest:
    version: int
    entries: list[TensorEntry]
    buckets: list[BucketInfo]
    total_bytes: int
    checksum_algo: str = ALGO
    format: int = FORMAT

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["entries"] = [{**e, "shape": list(e["shape"])} for e in d["entries"]]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"manifest: not valid JSON ({e})") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        return _parse(data)

    def specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape)."""
        return {e.name: (e.dtype, e.shape) for e in self.entries}


def _int(value: Any, field: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ManifestError(f"{field}: expected an integer >= {minimum}, got {value!r}")
    return value


def _parse_entry(e: Any, i: int) -> TensorEntry:
    f = f"manifest.entries[{i}]"
    if not isinstance(e, dict):
        raise ManifestError(f"{f}: expected an object, got {type(e).__name__}")
    missing = {"name", "dtype", "shape", "bucket", "offset", "nbytes"} - e.keys()
    if missing:
        raise ManifestError(f"{f}: missing field(s) {sorted(missing)}")
    if not isinstance(e["name"], str) or not e["name"]:
        raise ManifestError(f"{f}.name: expected a non-empty string, got {e['name']!r}")
    f = f"manifest.entries[{i}] ({e['name']})"
    if e["dtype"] not in DTYPES:
        raise ManifestError(f"{f}.dtype: unsupported dtype {e['dtype']!r} (supported: {sorted(DTYPES)})")
    if not isinstance(e["shape"], list):
        raise ManifestError(f"{f}.shape: expected a list of integers, got {e['shape']!r}")
    shape = tuple(_int(s, f"{f}.shape", 0) for s in e["shape"])
    entry = TensorEntry(
        name=e["name"], dtype=e["dtype"], shape=shape, bucket=_int(e["bucket"], f"{f}.bucket"),
        offset=_int(e["offset"], f"{f}.offset"), nbytes=_int(e["nbytes"], f"{f}.nbytes"),
    )
    numel = 1
    for s in shape:
        numel *= s
    expected = numel * DTYPES[entry.dtype].itemsize
    if entry.nbytes != expected:
        raise ManifestError(f"{f}.nbytes: {entry.nbytes} != numel*itemsize = {expected}")
    if entry.offset % ALIGN:
        raise ManifestError(f"{f}.offset: {entry.offset} is not a multiple of {ALIGN}")
    return entry


def _parse(data: Any) -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(f"manifest: expected a JSON object, got {type(data).__name__}")
    for key in ("version", "entries", "buckets", "total_bytes"):
        if key not in data:
            raise ManifestError(f"manifest.{key}: missing")
    if data.get("format", FORMAT) != FORMAT:
        raise ManifestError(f"manifest.format: unsupported format {data.get('format')!r} (expected {FORMAT})")
    algo = data.get("checksum_algo", ALGO)
    if algo not in CHECKSUM_ALGOS:
        raise ManifestError(f"manifest.checksum_algo: unsupported {algo!r} (expected one of {list(CHECKSUM_ALGOS)})")
    version = _int(data["version"], "manifest.version")
    if not isinstance(data["entries"], list) or not data["entries"]:
        raise ManifestError("manifest.entries: expected a non-empty list")
    if not isinstance(data["buckets"], list) or not data["buckets"]:
        raise ManifestError("manifest.buckets: expected a non-empty list")
    entries = [_parse_entry(e, i) for i, e in enumerate(data["entries"])]
    buckets = []
    for i, b in enumerate(data["buckets"]):
        if not isinstance(b, dict) or "nbytes" not in b:
            raise ManifestError(f"manifest.buckets[{i}]: expected an object with 'nbytes'")
        crc = b.get("checksum")
        if crc is not None:
            crc = _int(crc, f"manifest.buckets[{i}].checksum")
            if crc >= 1 << 64:
                raise ManifestError(f"manifest.buckets[{i}].checksum: {crc} does not fit in 64 bits")
        buckets.append(BucketInfo(nbytes=_int(b["nbytes"], f"manifest.buckets[{i}].nbytes"), checksum=crc))
    m = Manifest(version, entries, buckets, _int(data["total_bytes"], "manifest.total_bytes"), checksum_algo=algo)
    _check_layout(m)
    return m


def _check_layout(m: Manifest) -> None:
    """Names unique, every entry inside its bucket, no overlaps, sizes add up."""
    seen: set[str] = set()
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for e in m.entries:
        if e.name in seen:
            raise ManifestError(f"manifest.entries: duplicate name {e.name!r}")
        seen.add(e.name)
        if e.bucket >= len(m.buckets):
            raise ManifestError(f"manifest.entries ({e.name}).bucket: {e.bucket} >= number of buckets {len(m.buckets)}")
        if e.offset + e.nbytes > m.buckets[e.bucket].nbytes:
            raise ManifestError(f"manifest.entries ({e.name}).offset: tensor ends past bucket {e.bucket}")
        spans.setdefault(e.bucket, []).append((e.offset, e.offset + e.nbytes, e.name))
    for b, sp in spans.items():
        sp.sort()
        for (_, end, name), (start, _, nxt) in zip(sp, sp[1:]):
            if start < end:
                raise ManifestError(f"manifest.entries: {name!r} and {nxt!r} overlap in bucket {b}")
    total = sum(b.nbytes for b in m.buckets)
    if total != m.total_bytes:
        raise ManifestError(f"manifest.total_bytes: {m.total_bytes} != sum of bucket nbytes {total}")


def check_against(m: Manifest, params: dict[str, torch.Tensor]) -> torch.device:
    """Every served tensor present with the same shape and dtype, and nothing else.

    Returns the device of the served tensors; raises ManifestError naming the tensor.
    """
    names = {e.name for e in m.entries}
    missing, extra = sorted(set(params) - names), sorted(names - set(params))
    if missing:
        raise ManifestError(f"manifest: missing {len(missing)} tensor(s) of the served model: {missing[:5]}")
    if extra:
        raise ManifestError(f"manifest: {len(extra)} tensor(s) unknown to the served model: {extra[:5]}")
    slack = m.total_bytes - sum(e.nbytes for e in m.entries)
    if slack > ALIGN * len(m.entries):  # buckets larger than their tensors: nothing to stage there
        raise ManifestError(f"manifest.buckets: {slack} bytes beyond the tensors' own (at most "
                            f"{ALIGN * len(m.entries)} of alignment padding)")
    for e in m.entries:
        p = params[e.name]
        if tuple(p.shape) != e.shape:
            raise ManifestError(f"manifest ({e.name}).shape: {list(e.shape)} but served is {list(p.shape)}")
        if dtype_name(p.dtype) != e.dtype:
            raise ManifestError(f"manifest ({e.name}).dtype: {e.dtype!r} but served is {dtype_name(p.dtype)!r}")
    return next(iter(params.values())).device


def served_dtype(params: dict[str, torch.Tensor]) -> str | None:
    """The most common floating dtype among `params` (by numel): what a sender should cast to."""
    counts: dict[str, int] = {}
    for t in params.values():
        if t.is_floating_point():
            counts[dtype_name(t.dtype)] = counts.get(dtype_name(t.dtype), 0) + t.numel()
    return max(counts, key=counts.__getitem__) if counts else None
