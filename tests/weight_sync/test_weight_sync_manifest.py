"""Unit tests: manifest JSON round-trip and validation, bucket pack/unpack (bf16 too), digest.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_manifest.py
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.weight_sync.named_tensors import random_tensors
from weight_sync.bucket import pack_stream, plan_buckets, specs_of, unpack
from weight_sync.checksum import checksum, parallel_checksums
from weight_sync.errors import ManifestError
from weight_sync.manifest import ALIGN, Manifest, weights_digest

SPEC = {"model.embed_tokens.weight": ((50, 16), torch.float32),
        "model.layers.0.self_attn.q_proj.weight": ((16, 16), torch.bfloat16),
        "model.layers.0.input_layernorm.weight": ((16,), torch.float16),
        "model.norm.weight": ((16,), torch.float32)}


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    return {**random_tensors(SPEC, seed),
            "step": torch.tensor(7),  # 0-dim int64
            "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 4)}


def pack_all(named: dict[str, torch.Tensor], bucket_bytes: int, dtype=None) -> tuple[Manifest, list[torch.Tensor]]:
    m = plan_buckets(specs_of(named.items(), dtype), bucket_bytes, version=3)
    bufs = []
    for i, buf, crc in pack_stream(m, iter(named.items()), lambda i, n: torch.full((n,), 7, dtype=torch.uint8)):
        assert crc == checksum(buf)  # hashed while packing == hashed afterwards (padding zeroed)
        m.buckets[i].checksum = crc
        bufs.append(buf.clone())
    return m, bufs


def test_manifest_json_roundtrip():
    m, _ = pack_all(tensors(), 1024)
    text = m.to_json()
    assert json.loads(text)["entries"][0]["shape"] == [50, 16]
    assert Manifest.from_json(text) == m
    assert m.total_bytes == sum(b.nbytes for b in m.buckets)
    assert all(e.offset % ALIGN == 0 for e in m.entries)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.pop("version"), "manifest.version"),
        (lambda d: d.update(version=-1), "manifest.version"),
        (lambda d: d.update(entries=[]), "manifest.entries"),
        (lambda d: d["entries"][0].pop("dtype"), "manifest.entries[0]"),
        (lambda d: d["entries"][1].update(dtype="float8"), "q_proj.weight).dtype"),
        (lambda d: d["entries"][0].update(shape=[50, -16]), "embed_tokens.weight).shape"),
        (lambda d: d["entries"][0].update(shape="50x16"), "embed_tokens.weight).shape"),
        (lambda d: d["entries"][0].update(nbytes=12), "embed_tokens.weight).nbytes"),
        (lambda d: d["entries"][0].update(offset=3), "embed_tokens.weight).offset"),
        (lambda d: d["entries"][0].update(bucket=99), "embed_tokens.weight).bucket"),
        (lambda d: d["entries"][1].update(name=d["entries"][0]["name"]), "duplicate name"),
        (lambda d: d["buckets"][0].update(nbytes=8), "tensor ends past bucket"),
        (lambda d: d["buckets"][0].update(checksum="abc"), "manifest.buckets[0].checksum"),
        (lambda d: d.update(total_bytes=1), "manifest.total_bytes"),
        (lambda d: d.update(format=1), "manifest.format"),
    ],
)
def test_manifest_validation_names_the_field(mutate, field):
    m, _ = pack_all(tensors(), 1 << 20)
    d = m.to_dict()
    mutate(d)
    with pytest.raises(ManifestError, match=field.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Manifest.from_dict(d)


def test_manifest_rejects_overlap_and_bad_json():
    m, _ = pack_all(tensors(), 1 << 20)
    d = m.to_dict()
    d["entries"][1]["offset"] = 0  # overlaps entry 0 in bucket 0
    with pytest.raises(ManifestError, match="overlap"):
        Manifest.from_dict(d)
    with pytest.raises(ValueError, match="not valid JSON"):
        Manifest.from_json("{nope")


def test_pack_unpack_roundtrip_views_and_bf16():
    named = tensors()
    m, bufs = pack_all(named, 512)
    assert len(m.buckets) > 2
    out = {}
    for i, buf in enumerate(bufs):
        for name, view in unpack(buf, m, i):
            assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # zero-copy
            out[name] = view
    assert out.keys() == named.keys()
    for name, t in named.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_big_tensor_gets_own_bucket_and_dtype_cast():
    named = {"a": torch.randn(10), "big": torch.randn(1000), "b": torch.randn(10), "ids": torch.arange(5)}
    m, bufs = pack_all(named, 256, dtype=torch.bfloat16)
    by_name = {e.name: e for e in m.entries}
    assert by_name["big"].nbytes == 2000 and m.buckets[by_name["big"].bucket].nbytes == 2000
    assert by_name["a"].dtype == "bfloat16" and by_name["ids"].dtype == "int64"  # ints never cast
    views = dict(v for i, buf in enumerate(bufs) for v in unpack(buf, m, i))
    assert torch.equal(views["big"], named["big"].bfloat16())


def test_pack_stream_rejects_source_mismatch():
    named = tensors()
    m = plan_buckets(specs_of(named.items()), 1024)
    swapped = list(named.items())[::-1]
    with pytest.raises(ManifestError, match="same order"):
        list(pack_stream(m, iter(swapped), lambda i, n: torch.empty(n, dtype=torch.uint8)))
    with pytest.raises(ManifestError, match="ended before"):
        list(pack_stream(m, iter(list(named.items())[:2]), lambda i, n: torch.empty(n, dtype=torch.uint8)))


def test_unpack_rejects_truncated_bucket():
    m, bufs = pack_all(tensors(), 1024)
    with pytest.raises(ManifestError, match="bucket 0: has"):
        unpack(bufs[0][:-1], m, 0)


def test_digest_stable_and_sensitive():
    a, b = tensors(0), tensors(0)
    d = weights_digest(a)
    assert d == weights_digest(list(reversed(list(b.items()))))  # order-independent
    assert d == weights_digest(iter(a.items()))
    b["model.norm.weight"][3] += 1e-3
    assert weights_digest(b) != d
    c = tensors(0)
    c["model.norm.weight"] = c["model.norm.weight"].double()
    assert weights_digest(c) != d  # dtype is part of the digest
    e = tensors(0)
    e["model.norm.weight"] = e["model.norm.weight"].view(4, 4)
    assert weights_digest(e) != d  # so is the shape
    assert len(d) == 32 and int(d, 16) >= 0


def test_parallel_checksums_match_serial():
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (0, 1, 1000, 1 << 16)]
    assert parallel_checksums(bufs) == [checksum(b) for b in bufs]
