"""The /weights/* admin routes (server.api.routes_weights) in-process: status codes, messages, engine window.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_routes.py

Uses FastAPI's TestClient on a minimal app with an idle real `server.engine.engine.Engine` (its
backend only a model; pause records its calls and can simulate a sequence in flight), and
once a real `dllm.model.SDARForCausalLM` (tied embeddings) with `dllm.weights.copy_into_model`.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from dllm.weights import hf_tensors
from server.api import routes_weights
from server.api.state import ServerState, attach
from server.config import ServerConfig
from server.engine import engine as engine_module
from server.engine.backends.base import RunnerInfo
from server.engine.scheduler import KVBudget
from server.weights.weight_updates import WeightUpdates, make_updates
from weight_sync import weights_digest
from weight_sync.bucket import pack_stream, plan_buckets, specs_of
from weight_sync.checksum import checksum as crc32

TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Engine(engine_module.Engine):
    """The real engine, never started (its backend only a model): pause and resume are recorded;
    `busy` = a sequence in flight that only an abort (or clearing busy) ends."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(SimpleNamespace(model=model, kv_budget=KVBudget(1), postprocessor=lambda: None,
                                         info=RunnerInfo("sdar")))
        self.calls, self.busy = [], False

    async def pause(self, abort_inflight: bool = False, timeout: float | None = None) -> None:
        await super().pause(abort_inflight, timeout)
        self.calls.append(("pause", abort_inflight))
        if abort_inflight:
            self.busy = False
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"engine did not drain within {timeout}s")
            await asyncio.sleep(0.01)

    async def resume(self) -> None:
        await super().resume()
        self.calls.append(("resume",))


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4).bfloat16())


def make_client(model: torch.nn.Module) -> tuple[TestClient, Engine]:
    app = FastAPI()
    engine = Engine(model)
    st = attach(app, ServerState(engine, admin_token=TOKEN, weight_updates=make_updates(engine, ServerConfig(keep_versions=0))))
    app.include_router(routes_weights.router)
    return TestClient(app), st.engine


def packed(model: torch.nn.Module, version: int) -> tuple[dict, list[torch.Tensor]]:
    named = list(hf_tensors(model))  # HF names (an SDAR model's fused q/k/v split into views)
    m = plan_buckets(specs_of(named), 256, version)
    bufs = [b.clone() for _, b, _ in pack_stream(m, iter(named), lambda i, n: torch.empty(n, dtype=torch.uint8))]
    return m.to_dict(), bufs


def put(client: TestClient, i: int, data: bytes, version: int = 1, crc: int | str | None = None, run_id: str = ""):
    headers = {**AUTH, "X-Weights-Version": str(version), "X-Weights-Run-Id": run_id}
    if crc is not None:
        headers["X-Bucket-Checksum"] = str(crc)
    return client.put(f"/weights/bucket/{i}", content=data, headers=headers)


def http_update(client: TestClient, src: torch.nn.Module, version: int, **commit) -> dict:
    manifest, bufs = packed(src, version)
    r = client.post("/weights/begin", json={"version": version, "transport": "http", "manifest": manifest},
                    headers=AUTH)
    assert r.status_code == 200, r.text
    for i, b in enumerate(bufs):
        assert put(client, i, b.numpy().tobytes(), version, crc32(b)).status_code == 200
    r = client.post("/weights/commit", json={"version": version, **commit}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def test_auth_required():
    client, _ = make_client(tiny_model(0))
    assert client.get("/weights/version").status_code == 401
    assert client.get("/weights/version", headers={"Authorization": "Bearer nope"}).status_code == 403


def test_http_update_pauses_applies_resumes():
    client, engine = make_client(tiny_model(0))
    src = tiny_model(1)
    assert http_update(client, src, 1) == {"version": 1, "state": "applied", "served_version": 1}
    assert engine.version == 1 and engine.calls == [("pause", False), ("resume",)]
    digest = client.get("/weights/checksum", headers=AUTH).json()
    assert digest == {"version": 1, "digest": weights_digest(src.named_parameters())}
    status = client.get("/weights/version", headers=AUTH).json()
    assert status["version"] == 1 and status["update"] is None and status["is_paused"] is False


def make_updates_app(model: torch.nn.Module, drain_timeout_s: float) -> tuple[FastAPI, Engine]:
    app = FastAPI()
    engine = Engine(model)
    attach(app, ServerState(engine, admin_token=TOKEN,
                            weight_updates=WeightUpdates(engine, drain_timeout_s=drain_timeout_s)))
    app.include_router(routes_weights.router)
    return app, engine


def test_admin_paused_engine_stays_paused_and_abort_inflight_after_the_drain_bound():
    app, engine = make_updates_app(tiny_model(0), drain_timeout_s=0.2)
    asyncio.run(engine.pause())  # an admin's pause
    engine.calls.clear()
    engine.busy = True
    with TestClient(app) as client:
        http_update(client, tiny_model(1), 1, abort_inflight=True)
    assert engine.is_paused and engine.calls == [("pause", False), ("pause", True)]  # drain, then abort
    assert engine.version == 1


def test_commit_pending_while_sequences_drain_then_applied():
    """abort_inflight false: past the drain bound the commit answers 202 pending; in-flight
    sequences finish on the old weights, then the update is applied; a retried commit says applied."""
    app, engine = make_updates_app(tiny_model(0), drain_timeout_s=0.2)
    engine.busy = True
    src = tiny_model(1)
    manifest, bufs = packed(src, 1)
    with TestClient(app) as client:
        assert client.post("/weights/begin", json={"version": 1, "transport": "http", "manifest": manifest,
                                                   "run_id": "r1"}, headers=AUTH).status_code == 200
        for i, b in enumerate(bufs):
            assert put(client, i, b.numpy().tobytes(), 1, crc32(b), run_id="r1").status_code == 200
        r = client.post("/weights/commit", json={"version": 1}, headers=AUTH)  # the anonymous run: not the owner
        assert r.status_code == 409 and "belongs to run 'r1'" in r.json()["detail"]
        r = client.post("/weights/commit", json={"version": 1, "run_id": "r1"}, headers=AUTH)
        assert r.status_code == 202 and r.json() == {"version": 1, "state": "pending", "served_version": 0}
        assert client.get("/weights/updates/1", headers=AUTH).json()["state"] == "draining"
        assert engine.version == 0  # in-flight sequences still run on the old weights
        engine.busy = False  # they finish
        deadline = time.monotonic() + 10
        while client.get("/weights/updates/1", headers=AUTH).json()["state"] != "applied":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert engine.version == 1 and not engine.is_paused
        r = client.post("/weights/commit", json={"version": 1, "run_id": "r1"}, headers=AUTH)  # a retried commit
        assert r.status_code == 200 and r.json()["state"] == "applied"
        r = client.post("/weights/commit", json={"version": 1, "run_id": "r2"}, headers=AUTH)
        assert r.status_code == 409 and "belongs to run 'r1'" in r.json()["detail"]
        assert client.get("/weights/checksum", headers=AUTH).json()["digest"] == weights_digest(
            src.named_parameters())
        assert client.get("/weights/updates/7", headers=AUTH).json()["state"] == "unknown"


def test_abort_while_draining_cancels_the_update():
    app, engine = make_updates_app(tiny_model(0), drain_timeout_s=0.1)
    engine.busy = True
    before = weights_digest(engine.model.named_parameters())
    manifest, bufs = packed(tiny_model(1), 1)
    with TestClient(app) as client:
        client.post("/weights/begin", json={"version": 1, "transport": "http", "manifest": manifest}, headers=AUTH)
        for i, b in enumerate(bufs):
            put(client, i, b.numpy().tobytes(), 1, crc32(b))
        assert client.post("/weights/commit", json={"version": 1}, headers=AUTH).status_code == 202
        assert client.post("/weights/abort", json={"version": 1, "reason": "gave up"}, headers=AUTH).json()[
            "aborted"]
        deadline = time.monotonic() + 10
        while engine.is_paused:  # the drain task notices and resumes the engine
            assert time.monotonic() < deadline
            time.sleep(0.02)
        state = client.get("/weights/updates/1", headers=AUTH).json()
        assert state["state"] == "failed" and state["reason"] == "gave up"
    assert engine.version == 0 and weights_digest(engine.model.named_parameters()) == before


def test_error_statuses_and_messages():
    client, engine = make_client(tiny_model(0))
    manifest, bufs = packed(tiny_model(1), 1)
    begin = {"version": 1, "transport": "http", "manifest": manifest}
    r = client.post("/weights/commit", json={"version": 1}, headers=AUTH)
    assert r.status_code == 409 and "no weight update in progress" in r.json()["detail"]
    assert client.post("/weights/begin", json={**begin, "transport": "smoke"}, headers=AUTH).status_code == 422
    assert client.post("/weights/begin", json={"version": 1}, headers=AUTH).status_code == 422
    bad = {**manifest, "entries": manifest["entries"][1:]}
    r = client.post("/weights/begin", json={**begin, "manifest": bad}, headers=AUTH)
    assert r.status_code == 400 and "begin: manifest: missing 1 tensor" in r.json()["detail"]
    assert client.post("/weights/begin", json=begin, headers=AUTH).status_code == 200
    r = client.post("/weights/begin", json={**begin, "version": 2,
                                            "manifest": {**manifest, "version": 2}}, headers=AUTH)
    assert r.status_code == 409 and "already receiving" in r.json()["detail"]
    raw = bufs[0].numpy().tobytes()
    r = put(client, 0, raw[:-3], crc=crc32(bufs[0]))
    assert r.status_code == 400 and "truncated" in r.json()["detail"]
    r = put(client, 0, raw + b"xx")
    assert r.status_code == 400 and "longer than" in r.json()["detail"]
    r = put(client, 0, raw, crc=crc32(bufs[0]) ^ 1)
    assert r.status_code == 400 and "checksum mismatch" in r.json()["detail"]
    assert put(client, 0, raw, crc="abc").status_code == 400
    assert put(client, 99, raw).status_code == 400
    assert put(client, 0, raw, version=7).status_code == 409
    r = client.post("/weights/commit", json={"version": 1}, headers=AUTH)
    assert r.status_code == 400 and "incomplete" in r.json()["detail"]
    assert engine.version == 0 and engine.calls == []  # never paused: nothing was applied
    assert client.post("/weights/begin", json=begin, headers=AUTH).status_code == 200
    assert client.post("/weights/abort", json={"reason": "test"}, headers=AUTH).json()["aborted"] is True
    assert client.post("/weights/abort", headers=AUTH).json() == {"aborted": False, "version": 0}
    asyncio.run(engine.apply_update(5, lambda: None))  # e.g. a rollback: the receiver reads the engine's version
    r = client.post("/weights/begin", json=begin, headers=AUTH)
    assert r.status_code == 409 and "not greater than the current version 5" in r.json()["detail"]


def test_real_sdar_model_with_tied_embeddings():
    dllm_config = pytest.importorskip("dllm.config")
    dllm_model = pytest.importorskip("dllm.model")
    cfg = dllm_config.SDARConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 tie_word_embeddings=True, mask_token_id=63, eos_token_id=62)
    torch.manual_seed(0)
    served, trained = dllm_model.SDARForCausalLM(cfg), dllm_model.SDARForCausalLM(cfg)
    client, engine = make_client(served)
    http_update(client, trained, 1)
    digest = client.get("/weights/checksum", headers=AUTH).json()["digest"]
    assert digest == weights_digest(trained.hf_named_tensors())
    assert torch.equal(served.lm_head.weight, trained.model.embed_tokens.weight)
