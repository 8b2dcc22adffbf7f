"""Bounded drain at commit with a real Engine: in-flight sequences are aborted or finish on the old weights.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_drain.py

A real server (tests/conftest.py `make_server`, drain bound 0.3 s) runs one long
generation while a push commits. With abort_inflight the sequence ends with
finish_reason "abort" on the old version and the update is applied; without it the
commit answers "pending", the sequence finishes ("length") on the old weights and the
push still reports success once the server applied the update: both sides agree.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from weight_sync import WeightSender, weights_digest

TOKEN = "drain-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
pytestmark = pytest.mark.slow


def long_generation(url: str, out: list) -> threading.Thread:
    body = {"prompt": "1+2=", "max_tokens": 400, "temperature": 0, "strategy": "static", "steps": 4,
            "ignore_eos": True}

    def run() -> None:
        out.append(httpx.post(url + "/generate", json=body, timeout=300).json())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_running(engine, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 30
    while engine.num_running == 0:
        assert thread.is_alive() and time.monotonic() < deadline, "generation did not start"
        time.sleep(0.005)


def perturbed(srv, seed: float) -> dict:
    return {n: p.detach() + seed for n, p in srv.engine.model.hf_named_tensors()}


@pytest.fixture(scope="module")
def srv(make_server):
    return make_server(admin_token=TOKEN, max_batch=2, max_model_len=512, weight_sync_drain_timeout_s=0.3)


@pytest.mark.parametrize("abort_inflight", [True, False])
def test_commit_drain_is_bounded(srv, abort_inflight):
    v0 = srv.engine.version
    named = perturbed(srv, 0.001 * (v0 + 1))
    out: list = []
    gen = long_generation(srv.url, out)
    wait_running(srv.engine, gen)
    sender = WeightSender([srv.url], transport="http", token=TOKEN, abort_inflight=abort_inflight, timeout=120)
    try:
        timings = sender.push(named, v0 + 1)
    finally:
        sender.close()
    gen.join(120)
    sample = out[0]["samples"][0]
    assert sample["version"] == v0  # never mixes versions
    if abort_inflight:
        assert sample["finish_reason"] == "abort" and len(sample["completion_ids"]) < 400
        assert timings["commit_s"] < 20
    else:
        assert sample["finish_reason"] == "length" and len(sample["completion_ids"]) == 400
    served = httpx.get(srv.url + "/weights/checksum", headers=AUTH, timeout=30).json()
    assert served == {"version": v0 + 1, "digest": weights_digest(named)}
    assert httpx.get(srv.url + f"/weights/updates/{v0 + 1}", headers=AUTH, timeout=30).json()["state"] == "applied"
    assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200
