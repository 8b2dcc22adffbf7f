"""End to end: push trained weights into a real dlrl server (tests/conftest.py `make_server`).

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_e2e.py

A fresh server (real Engine, NativeBackend, tiny random SDAR model) receives pushes over
http, shm and dist from this process; after each push `/weights/checksum` equals the
trainer-side `weights_digest`, greedy generations equal the trainer-side model's,
`/health` reports the new version, and generations carry it. A rejected push (stale version) leaves everything unchanged.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from weight_sync import WeightSyncError, push, weights_digest

TOKEN = "secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


PROMPTS = ["1+2=", "34+5=", "hello"]


def served_greedy(url: str) -> list[list[int]]:
    body = {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "strategy": "static", "ignore_eos": True}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [s["completion_ids"] for s in sorted(r.json()["samples"], key=lambda s: s["prompt_index"])]


def local_greedy(model, model_dir: str) -> list[list[int]]:
    from dllm.decoding import generate
    from dllm.sampling import SamplingParams
    from dllm.tokenizer import encode, load_tokenizer

    tok = load_tokenizer(model_dir)
    outs = generate(model, [encode(tok, p) for p in PROMPTS],
                    SamplingParams(max_tokens=12, temperature=0, strategy="static", ignore_eos=True))
    return [o.completion_ids for o in outs]


def test_push_into_real_server(make_server, tiny_model_dir):
    from dllm.weights import load_pretrained

    srv = make_server(admin_token=TOKEN, max_batch=4, max_model_len=128)
    trained = load_pretrained(tiny_model_dir)
    for version, transport in enumerate(["http", "shm", "dist"], start=1):
        perturb(trained, version)
        timings = push([srv.url], trained.hf_named_tensors(), version, transport=transport, token=TOKEN,
                       dtype="auto", bucket_bytes=1 << 16)
        assert timings["num_buckets"] > 1
        served = httpx.get(srv.url + "/weights/checksum", headers=AUTH, timeout=30).json()
        assert served == {"version": version, "digest": weights_digest(trained.hf_named_tensors())}, transport
        assert served_greedy(srv.url) == local_greedy(trained, tiny_model_dir), transport
    assert httpx.get(srv.url + "/health", timeout=10).json()["version"] == 3
    r = httpx.post(srv.url + "/generate", json={"prompt": "1+2=", "max_tokens": 8, "n": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 3 and {s["version"] for s in r.json()["samples"]} == {3}
    with pytest.raises(WeightSyncError, match="409.*not greater than the current version 3"):
        push([srv.url], trained.hf_named_tensors(), 3, transport="http", token=TOKEN)
    assert httpx.get(srv.url + "/weights/checksum", headers=AUTH, timeout=30).json()["version"] == 3
    assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200  # resumed after every update
