"""Weight sync over real transports: a sender in a separate process pushes into a receiver app.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_transports.py

The receiver is a minimal FastAPI app (server.api.routes_weights + a fake engine with
pause/resume/version/model) served by uvicorn on 127.0.0.1 in a thread of this process;
the sender is a fresh Python subprocess calling `weight_sync.push` (shm, dist/gloo, http).
Checks: after a push the served digest equals the sender's and the version is the pushed
one; a sender killed mid-transfer leaves weights and version unchanged (the receiver aborts
on timeout or on the broken connection) and a new sender can push afterwards (the
roundtrip test runs after the kill test on the same receiver: module-scoped fixture).

`ReceiverServer(app)` is fixture-friendly: the end-to-end tests against `dlrl serve` can
reuse `run_sender` / `SENDER` with the real server's URL and admin token.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi import FastAPI

from server.api import routes_weights
from server.api.state import ServerState, attach
from server.config import ServerConfig
from server.engine.backends.base import RunnerInfo
from server.engine.engine import Engine
from server.engine.scheduler import KVBudget
from server.weights.weight_updates import make_updates
from tests.weight_sync.named_tensors import tiny_model
from weight_sync import WeightSyncError, push

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token"

SENDER = '''
from tests.weight_sync.named_tensors import tiny_model as make  # the test's model, drawn from the same seed
import json, os, signal, sys
from weight_sync import WeightSender, weights_digest
urls, transport, die_after, timeout = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
versions = [int(v) for v in sys.argv[5].split(",")]
sender = WeightSender(urls, transport=transport, token=os.environ["TOKEN"], bucket_bytes=4096,
                      timeout=max(timeout, 30.0), lease_s=timeout)
for v in versions:
    named, calls = make(v), []
    def source(named=named, calls=calls):
        calls.append(1)  # call 1 reads the shapes, call 2 (after begin) feeds the data plane
        for k, (n, t) in enumerate(named.items()):
            if k == die_after and len(calls) == 2:  # killed mid-transfer: some buckets already sent
                print(json.dumps({"dying": v}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            yield n, t
    timings = sender.push(source, v)  # one sender: the second push reuses its shm region / dist group
    print(json.dumps({"version": v, "digest": weights_digest(named), **timings}), flush=True)
sender.close()
'''
make = tiny_model  # version v of the model: its seed


class FakeModel(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.embed = torch.nn.Module()
        self.embed.weight = torch.nn.Parameter(tensors["embed.weight"].clone())
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].weight = torch.nn.Parameter(tensors["layers.0.weight"].clone())
        self.layers[0].bias = torch.nn.Parameter(tensors["layers.0.bias"].clone())
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(tensors["norm.weight"].clone())
        self.norm.bias = torch.nn.Parameter(tensors["norm.bias"].clone())


class FakeEngine(Engine):
    """The real server.engine.engine.Engine, never started, its backend only a model: what the weight routes use."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(SimpleNamespace(model=model, kv_budget=KVBudget(1), postprocessor=lambda: None,
                                         info=RunnerInfo("sdar")))


def make_app(engine: FakeEngine, timeout_s: float = 30.0) -> FastAPI:
    app = FastAPI()
    st = attach(app, ServerState(engine, admin_token=TOKEN, weight_updates=make_updates(engine, ServerConfig(keep_versions=0))))
    st.weight_updates.receiver.lease_s = timeout_s
    app.include_router(routes_weights.router)
    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReceiverServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app: FastAPI):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ReceiverServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()


def run_sender(url: str, transport: str, versions: list[int], die_after: int = -1, timeout: float = 30.0,
               token: str = TOKEN) -> tuple[int, list[dict], str]:
    env = {**os.environ, "TOKEN": token, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", SENDER, url, transport, str(die_after), str(timeout),
            ",".join(map(str, versions))]
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return p.returncode, lines, p.stderr


@pytest.fixture(scope="module", params=["shm", "dist", "http"])
def receiver(request):
    engine = FakeEngine(FakeModel(make(0)))
    with ReceiverServer(make_app(engine)) as srv:
        srv.engine, srv.transport = engine, request.param
        yield srv


def test_sender_killed_mid_transfer(receiver):
    before = receiver.get("/weights/checksum")
    v = before["version"] + 1
    rc, out, _ = run_sender(receiver.url, receiver.transport, [v], die_after=3, timeout=1.5)
    assert rc == -signal.SIGKILL and out == [{"dying": v}]
    deadline = time.monotonic() + 15
    while (status := receiver.get("/weights/version"))["update"] is not None:
        assert time.monotonic() < deadline, f"receiver did not abort: {status}"
        time.sleep(0.1)
    assert f"update to version {v} aborted" in status["last_failure"]
    assert receiver.get("/weights/checksum") == before  # weights and version unchanged
    # test_push_roundtrip runs next on the same receiver: a new sender must then succeed



def test_push_roundtrip(receiver):
    v0 = receiver.get("/weights/version")["version"]
    versions = [v0 + 1, v0 + 2]  # the second push reuses the cached shm region / dist group
    rc, out, err = run_sender(receiver.url, receiver.transport, versions)
    assert rc == 0, err
    assert [o["version"] for o in out] == versions
    assert out[0]["num_buckets"] > 1
    assert receiver.get("/weights/version")["version"] == versions[-1] == receiver.engine.version
    served = receiver.get("/weights/checksum")
    assert served["digest"] == out[-1]["digest"]
    for name, t in make(versions[-1]).items():
        assert torch.equal(dict(receiver.engine.model.named_parameters())[name].data, t), name
    assert not receiver.engine.is_paused


def test_wrong_token_fails_cleanly():
    with ReceiverServer(make_app(FakeEngine(FakeModel(make(0))))) as srv:
        with pytest.raises(WeightSyncError, match="connect failed with HTTP 403.*invalid admin token"):
            push([srv.url], make(5), 99, transport="http", token="wrong")
        assert srv.get("/weights/version")["update"] is None


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_push_to_two_servers(transport):
    """One shm region read by both servers / one dist group of 3 ranks (trainer + 2 servers)."""
    engines = [FakeEngine(FakeModel(make(0))) for _ in range(2)]
    with ReceiverServer(make_app(engines[0])) as a, ReceiverServer(make_app(engines[1])) as b:
        rc, out, err = run_sender(f"{a.url},{b.url}", transport, [1, 2])
        assert rc == 0, err
        assert out[-1]["num_servers"] == 2
        for srv in (a, b):
            assert srv.get("/weights/checksum") == {"version": 2, "digest": out[-1]["digest"]}
