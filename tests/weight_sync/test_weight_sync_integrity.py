"""Integrity of what is applied, one protocol module, region sweeping, the dist bind address, bf16 sends.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_integrity.py

- a bit flipped in the shm region after the sender's checksum is caught before apply;
  bytes changed in the region after verification are never applied (private staging);
- NaN/inf refused by default, accepted with check_finite=False;
- the server routes and the sender use the same pydantic models (weight_sync.protocol);
- sweep() unlinks regions of dead creators (flock free) and keeps live ones;
- a dist push through a TCPStore bound to 127.0.0.2 only;
- dtype="bfloat16" sends half the bytes, checksummed over what is sent.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI

from server.api import routes_weights
from server.api.state import ServerState, attach
from server.config import ServerConfig
from server.engine import engine as engine_module
from server.engine.backends.base import RunnerInfo
from server.engine.scheduler import KVBudget
from server.weights.weight_updates import make_updates
from tests.helpers import ServedTensors
from tests.weight_sync.named_tensors import random_tensors
from weight_sync import NonFiniteWeights, UpdateFailed, WeightSender, protocol, weights_digest
from weight_sync import control as control_module
from weight_sync import sender as sender_module
from weight_sync.bucket import pack_stream, plan_buckets, specs_of
from weight_sync.transports import shm as shm_module
from weight_sync.transports.shm import ShmRegion, sweep

TOKEN = "integrity-token"


def tensors(seed: int) -> dict[str, torch.Tensor]:
    return random_tensors({"w": ((64, 16), torch.float32), "b": ((16,), torch.bfloat16), "n": ((16,), torch.float32)}, seed)


def Served(check_finite: bool = True) -> ServedTensors:  # noqa: N802 - the served model of these tests
    return ServedTensors(tensors(0), check_finite=check_finite)


@pytest.fixture
def served():
    s = Served()
    yield s
    s.rx.close()


def shm_packed(new: dict[str, torch.Tensor], version: int, region: ShmRegion):
    m = plan_buckets(specs_of(new.items()), 1024, version)
    opts = region.prepare(m)
    checksums = [crc for _, _, crc in pack_stream(m, iter(new.items()), region.bucket, region.beat)]
    return m, opts, checksums


def test_bit_flipped_in_region_after_checksum_is_caught_before_apply(served):
    region = ShmRegion(run_id="flip")
    try:
        before = weights_digest(served.params)
        m, opts, checksums = shm_packed(tensors(1), 1, region)
        region.bucket(1, m.buckets[1].nbytes)[5] ^= 0x10  # one bit, after the sender hashed it
        served.rx.begin(1, "shm", m.to_dict(), opts)
        with pytest.raises(UpdateFailed, match=r"checksum mismatch in bucket\(s\) \[1\]"):
            served.commit(1, checksums)
        assert served.num_applied == 0 and weights_digest(served.params) == before and served.version == 0
    finally:
        region.close()


def test_region_changed_after_verify_is_not_applied(served):
    """Verification stages a private copy: writing the region between verify and apply changes nothing."""
    region = ShmRegion(run_id="toctou")
    try:
        new = tensors(2)
        m, opts, checksums = shm_packed(new, 1, region)
        served.rx.begin(1, "shm", m.to_dict(), opts)
        served.rx.verify(1, checksums)
        for i, b in enumerate(m.buckets):
            region.bucket(i, b.nbytes).fill_(0xFF)  # NaN everywhere, after verification
        served.apply(1)
        assert weights_digest(served.params) == weights_digest(new) and served.version == 1
    finally:
        region.close()


def test_non_finite_refused_by_default_and_allowed_when_disabled(served):
    bad = tensors(3)
    bad["w"][7, 3] = float("inf")
    bad["b"][2] = float("nan")
    region = ShmRegion(run_id="nan")
    try:
        m, opts, checksums = shm_packed(bad, 1, region)
        served.rx.begin(1, "shm", m.to_dict(), opts)
        with pytest.raises(NonFiniteWeights, match=r"non-finite .* in 2 tensor\(s\): \['w', 'b'\]") as e:
            served.commit(1, checksums)
        assert e.value.http_status == 400 and served.num_applied == 0
        lax = Served(check_finite=False)
        lax.rx.begin(1, "shm", m.to_dict(), opts)
        lax.commit(1, checksums)
        assert torch.isinf(lax.params["w"][7, 3]) and torch.isnan(lax.params["b"][2])
        lax.rx.close()
    finally:
        region.close()


def test_one_protocol_module_for_server_and_sender():
    for name in ("ConnectRequest", "BeginRequest", "CommitRequest", "AbortRequest"):
        model = getattr(protocol, name)
        assert getattr(routes_weights, name) is model
        assert getattr(sender_module, name, None) is model or getattr(control_module, name) is model
    for name in ("BeginResponse", "CommitResponse", "VersionResponse", "UpdateState", "ConnectResponse"):
        assert getattr(routes_weights, name) is getattr(control_module, name) is getattr(protocol, name)
    bodies = {r.path: r.body_field.field_info.annotation for r in routes_weights.router.routes
              if getattr(r, "body_field", None) is not None}
    assert bodies["/weights/begin"] is protocol.BeginRequest
    assert bodies["/weights/commit"] is protocol.CommitRequest
    with pytest.raises(ValueError, match="run_id"):
        protocol.BeginRequest(version=1, transport="shm", manifest={}, run_id="bad id with spaces")
    with pytest.raises(ValueError, match="checksums"):
        protocol.CommitRequest(version=1, checksums=[1 << 64])


CREATOR = """
import sys, time
from weight_sync.transports.shm import ShmRegion
from weight_sync.bucket import plan_buckets
r = ShmRegion(run_id=sys.argv[1])
print(r.prepare(plan_buckets([("x", "float32", (1024,))]))["name"], flush=True)
time.sleep(60)
"""


def test_sweep_unlinks_only_regions_of_dead_creators(monkeypatch):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", CREATOR, tag], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True) for tag in ("sweepalive", "sweepdead")]
    try:
        alive, dead = (p.stdout.readline().strip() for p in procs)
        os.killpg(procs[1].pid, 9)  # the creator and its resource tracker: nobody unlinks
        procs[1].wait(10)
        assert (Path("/dev/shm") / dead).exists() and (Path("/dev/shm") / alive).exists()
        assert sweep(grace_s=60) == []  # too young to judge
        later = time.time() + 3600
        monkeypatch.setattr(shm_module.time, "time", lambda: later)  # an hour later: every region is old
        assert sweep() == [dead]
        assert not (Path("/dev/shm") / dead).exists() and (Path("/dev/shm") / alive).exists()
        fd = os.open(Path("/dev/shm") / alive, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the live creator holds its lock
        os.close(fd)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        time.sleep(0.5)  # the live creator's resource tracker unlinks its region


class Engine(engine_module.Engine):
    """The real server engine, never started, its backend only a model."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(SimpleNamespace(model=model, kv_budget=KVBudget(1), postprocessor=lambda: None,
                                         info=RunnerInfo("sdar")))


def module_of(named: dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, t in named.items():
        root.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def serve(app: FastAPI):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def make_app(engine: Engine) -> FastAPI:
    app = FastAPI()
    attach(app, ServerState(engine, admin_token=TOKEN, weight_updates=make_updates(engine, ServerConfig(keep_versions=0))))
    app.include_router(routes_weights.router)
    return app


def test_dist_store_binds_the_configured_address():
    engine = Engine(module_of(tensors(0)))
    server, thread, url = serve(make_app(engine))
    sender = WeightSender([url], transport="dist", token=TOKEN, dist_addr="127.0.0.2", bucket_bytes=1024)
    try:
        new = tensors(4)
        sender.push(new, 1)
        port = sender.dist.store.port
        with socket.socket() as s:  # nothing listens on the other loopback address
            assert s.connect_ex(("127.0.0.1", port)) != 0
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.2", port)) == 0
        sender.push(tensors(5), 2)  # the group is reused
        assert weights_digest(engine.model.named_parameters()) == weights_digest(tensors(5))
    finally:
        sender.close()
        server.should_exit = True
        thread.join(10)


def test_bf16_send_halves_the_bytes_and_checksums_what_is_sent():
    served = {n: t.bfloat16() for n, t in tensors(0).items()}
    engine = Engine(module_of(served))
    server, thread, url = serve(make_app(engine))
    new = tensors(6)  # fp32 trainer weights
    try:
        sender = WeightSender([url], transport="http", token=TOKEN, dtype="auto", bucket_bytes=1024)
        timings = sender.push(new, 1)
        sender.close()
        fp32_bytes = sum(t.numel() * 4 for t in new.values())
        assert timings["bytes"] <= fp32_bytes // 2 + 64 * timings["num_buckets"] * 3
        assert weights_digest(engine.model.named_parameters()) == weights_digest(
            {n: t.bfloat16() for n, t in new.items()})
    finally:
        server.should_exit = True
        thread.join(10)
