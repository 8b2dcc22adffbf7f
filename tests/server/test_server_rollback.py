"""Rollback to a kept weight version (issue 19) on a real server: /weights/kept follows the K
most recently served versions, a rollback restores the earlier version's /weights/checksum
exactly, a version not kept is a 404, a re-push of a rolled-back version applies again, and
requests in flight during a rollback all succeed."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from weight_sync import push, weights_digest

TOKEN = "rollback-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _perturbed(model_dir: str, seed: int) -> torch.nn.Module:
    from dllm.weights import load_pretrained

    model = load_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _get(url: str, path: str) -> dict:
    r = httpx.get(url + path, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _rollback(url: str, version: int, **extra) -> httpx.Response:
    return httpx.post(url + "/weights/rollback", json={"version": version, **extra}, headers=AUTH, timeout=120)


def _kept(url: str, expected: list[int]) -> None:
    deadline = time.monotonic() + 20  # a new version is copied to host memory just after its commit
    while _get(url, "/weights/kept")["versions"] != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _get(url, "/weights/kept")["versions"] == expected


def test_rollback_restores_checksum_and_follows_the_kept_versions(make_server, tiny_model_dir):
    srv = make_server(admin_token=TOKEN, max_batch=4, max_model_len=128, keep_versions=2)
    url = srv.url
    digest0 = _get(url, "/weights/checksum")["digest"]
    _kept(url, [0])
    v1 = _perturbed(tiny_model_dir, 1)
    push([url], v1.hf_named_tensors(), 1, transport="http", token=TOKEN)
    assert _get(url, "/weights/checksum")["digest"] == weights_digest(v1.hf_named_tensors()) != digest0
    _kept(url, [0, 1])

    r = _rollback(url, 0)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 0 and r.json()["previous_version"] == 1 and r.json()["digest"] == digest0
    assert _get(url, "/weights/checksum") == {"version": 0, "digest": digest0}
    assert httpx.get(url + "/health").json()["version"] == 0
    gen = httpx.post(url + "/generate", json={"prompt": "1+2=", "max_tokens": 4}, timeout=60).json()
    assert gen["samples"][0]["version"] == 0
    _kept(url, [1, 0])  # 0 is the most recently served now

    missing = _rollback(url, 7)
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith("rollback: version: 7")
    assert _get(url, "/weights/checksum")["digest"] == digest0

    # a rolled-back version pushed again is applied again (not answered "already applied")
    push([url], v1.hf_named_tensors(), 1, transport="http", token=TOKEN)
    assert _get(url, "/weights/checksum") == {"version": 1, "digest": weights_digest(v1.hf_named_tensors())}
    v2 = _perturbed(tiny_model_dir, 2)
    push([url], v2.hf_named_tensors(), 2, transport="http", token=TOKEN)
    _kept(url, [1, 2])  # K=2: version 0, served longest ago, is evicted
    assert _rollback(url, 0).status_code == 404
    assert _rollback(url, 1).json()["digest"] == weights_digest(v1.hf_named_tensors())
    assert _get(url, "/weights/checksum")["version"] == 1
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r'^dlrl_rollbacks_total\{model_name="[^"]+"\} 2.0$', metrics, re.M)
    assert re.search(r'^dlrl_served_version\{model_name="[^"]+"\} 1.0$', metrics, re.M)
    for body in ({"version": -1}, {"version": "one"}, {}, {"version": 1, "x": 0}):
        assert httpx.post(url + "/weights/rollback", json=body, headers=AUTH).status_code == 400
    assert httpx.post(url + "/weights/rollback", json={"version": 1}).status_code == 401


def test_keep_versions_zero_disables_rollback(make_server):
    srv = make_server(admin_token=TOKEN, max_batch=2, max_model_len=64, keep_versions=0)
    assert _get(srv.url, "/weights/kept")["versions"] == []
    assert _rollback(srv.url, 0).status_code == 404


@pytest.mark.slow
def test_rollback_while_requests_are_in_flight(make_server, tiny_model_dir):
    srv = make_server(admin_token=TOKEN, max_batch=8, max_queue=256, max_model_len=128, keep_versions=2)
    url = srv.url
    digest0 = _get(url, "/weights/checksum")["digest"]
    push([url], _perturbed(tiny_model_dir, 3).hf_named_tensors(), 1, transport="http", token=TOKEN)
    _kept(url, [0, 1])
    stop, results = threading.Event(), []

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(url + "/generate", json={"prompt": f"{k}+1=", "n": 2, "max_tokens": 24,
                                                    "ignore_eos": True})
                results.append((r.status_code, [s["version"] for s in r.json().get("samples", [])]))

    with ThreadPoolExecutor(6) as pool:
        for k in range(6):
            pool.submit(client, k)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = _rollback(url, 0)
        time.sleep(0.5)
        stop.set()
    assert r.status_code == 200, r.text
    assert _get(url, "/weights/checksum") == {"version": 0, "digest": digest0}
    assert results and all(status == 200 for status, _ in results), results
    assert {v for _, versions in results for v in versions} <= {0, 1}
    assert any(1 in versions for _, versions in results)  # in flight when the rollback came: finished on 1
    assert any(0 in versions for _, versions in results)  # requests after the rollback ran on version 0
