"""Weight sync against a real `dlrl serve` process: poisoned pushes, dead pushers, leaks, idempotent commits.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_faults.py

One server subprocess (tiny random SDAR model, lease 2 s) for the module. Pushers are
real subprocesses killed with real signals:
- a push holding NaN is refused with 400 and /weights/checksum is unchanged;
- a pusher subprocess SIGKILLed (with its whole process group, resource tracker included)
  right after `begin`: the next push from another run succeeds once the 2 s lease lapsed,
  the dead pusher's shared-memory region is swept, and a pusher resuming the *same* run
  takes over at once;
- 20 aborted dist updates leave the server's thread count where it was;
- a retried commit of an applied version answers "applied"; the outcome is queryable.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import admin_get, engine_core_pid, start_sync_server
from weight_sync import WeightSender, WeightSyncError, weights_digest

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "faults-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEASE_S = 2.0
pytestmark = pytest.mark.slow

PUSHER = '''
import json, os, signal, sys
from dllm.weights import load_pretrained
from weight_sync import push
url, model_dir, transport, version, run_id, lease = sys.argv[1:7]
named, calls = list(load_pretrained(model_dir).hf_named_tensors()), []
def source():
    calls.append(1)
    for k, (n, t) in enumerate(named):
        if len(calls) == 2 and k == 1:  # after begin, inside the data plane
            print(json.dumps({"dying": int(version)}), flush=True)
            os.killpg(os.getpgid(0), signal.SIGKILL)  # the pusher and its resource tracker
        yield n, t
push([url], source, int(version), transport=transport, token=os.environ["TOKEN"], run_id=run_id,
     bucket_bytes=1 << 16, timeout=60, lease_s=float(lease) if lease != "-" else None)
'''


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # CPU only, GPU or not: thread counts below must not see the CUDA driver's own threads
    with start_sync_server(tiny_model_dir, TOKEN, tmp_path_factory.mktemp("faults"), LEASE_S) as srv:
        yield srv


get = partial(admin_get, token=TOKEN)  # an admin GET that must answer 200 -> its JSON


def pusher(server, transport: str, version: int, run_id: str, mode: str = "die",
           lease_s: float | None = None) -> tuple[int, list[dict]]:
    """A pusher subprocess (its own session) that SIGKILLs its process group right after begin."""
    assert mode == "die"
    env = {**os.environ, "TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", PUSHER, server.url, server.model_dir, transport, str(version), run_id,
            "-" if lease_s is None else str(lease_s)]
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, start_new_session=True)
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return p.returncode, lines


def served_model(server) -> dict[str, torch.Tensor]:
    from dllm.weights import load_pretrained

    return dict(load_pretrained(server.model_dir).hf_named_tensors())


def test_nan_push_is_refused_and_nothing_changes(server):
    before = get(server.url, "/weights/checksum")
    named = served_model(server)
    named["model.norm.weight"] = named["model.norm.weight"].clone()
    named["model.norm.weight"][3] = float("nan")
    sender = WeightSender([server.url], transport="http", token=TOKEN, bucket_bytes=1 << 16)
    try:
        with pytest.raises(WeightSyncError, match=r"HTTP 400.*non-finite.*model\.norm\.weight"):
            sender.push(named, before["version"] + 1)
    finally:
        sender.close()
    assert get(server.url, "/weights/checksum") == before
    status = get(server.url, "/weights/version")
    assert status["update"] is None and "non-finite" in status["last_failure"]
    r = httpx.post(server.url + "/generate", json={"prompt": "1+2=", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


def perturbed(server, version: int) -> dict[str, torch.Tensor]:
    return {n: t + 0.01 * version for n, t in served_model(server).items()}


def push_in_process(server, transport: str, version: int, run_id: str) -> dict[str, torch.Tensor]:
    named = perturbed(server, version)
    sender = WeightSender([server.url], transport=transport, token=TOKEN, run_id=run_id, bucket_bytes=1 << 16,
                          timeout=60)
    try:
        sender.push(named, version)
    finally:
        sender.close()
    return named


def test_killed_pusher_does_not_lock_the_server(server):
    v = get(server.url, "/weights/version")["version"] + 1
    rc, out = pusher(server, "shm", v, "run-dead", mode="die")
    assert rc == -signal.SIGKILL and out == [{"dying": v}]
    status = get(server.url, "/weights/version")
    assert status["update"]["run_id"] == "run-dead"  # begun, now orphaned
    leaked = [p.name for p in Path("/dev/shm").glob("dlrl_ws_rundead_*")]
    assert leaked, "the killed pusher's region should still exist (its resource tracker died too)"
    t0 = time.monotonic()
    named = push_in_process(server, "shm", v, "run-other")  # waits for the 2 s lease, then pushes
    assert time.monotonic() - t0 < LEASE_S + 20
    assert get(server.url, "/weights/checksum") == {"version": v, "digest": weights_digest(named)}
    assert get(server.url, f"/weights/updates/{v}")["state"] == "applied"
    assert "lease expired: no data from run 'run-dead'" in get(server.url, "/weights/version")["last_failure"]
    assert not [n for n in leaked if (Path("/dev/shm") / n).exists()], "dead pusher's region not swept"


def test_resumed_run_takes_over_its_own_update(server):
    v = get(server.url, "/weights/version")["version"] + 1
    rc, out = pusher(server, "http", v, "run-resume", mode="die", lease_s=120)  # a long lease
    assert rc == -signal.SIGKILL
    assert get(server.url, "/weights/version")["update"]["run_id"] == "run-resume"
    t0 = time.monotonic()
    named = push_in_process(server, "http", v, "run-resume")  # same run: its connect takes over, no wait
    assert time.monotonic() - t0 < 60
    assert get(server.url, "/weights/checksum") == {"version": v, "digest": weights_digest(named)}
    assert "superseded by a new connect of run 'run-resume'" in get(server.url, "/weights/version")["last_failure"]


def test_commit_is_idempotent_and_queryable(server):
    v = get(server.url, "/weights/version")["version"] + 1
    push_in_process(server, "http", v, "run-idem")
    body = {"version": v, "run_id": "run-idem"}
    r = httpx.post(server.url + "/weights/commit", json=body, headers=AUTH, timeout=30)  # a retried commit
    assert r.status_code == 200 and r.json() == {"version": v, "state": "applied", "served_version": v}
    assert get(server.url, f"/weights/updates/{v}")["state"] == "applied"
    assert get(server.url, f"/weights/updates/{v + 5}")["state"] == "unknown"


def num_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def thread_names(pid: int) -> dict[str, int]:
    names: dict[str, int] = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


def test_aborted_dist_updates_leak_no_threads(server):
    named = served_model(server)
    calls = []

    def failing_source():
        calls.append(1)
        for k, (n, t) in enumerate(named.items()):
            if k == 3 and len(calls) % 2 == 0:  # every data-plane pass fails after a few tensors
                raise RuntimeError("gather failed")
            yield n, t

    sender = WeightSender([server.url], transport="dist", token=TOKEN, bucket_bytes=1 << 14, timeout=60)
    try:
        v = get(server.url, "/weights/version")["version"] + 1
        sender.push(named, v)  # warm-up: the server has joined a group once
        core = engine_core_pid(server.url)  # the receiver's threads live in the engine core
        baseline = num_threads(core)
        for _ in range(20):
            with pytest.raises(WeightSyncError, match="gather failed"):
                sender.push(failing_source, v + 1)
        deadline = time.monotonic() + 20
        while num_threads(core) > baseline + 2:
            assert time.monotonic() < deadline, f"threads {baseline} -> {thread_names(core)}"
            time.sleep(0.2)
        assert get(server.url, "/weights/version")["update"] is None
        sender.push(named, v + 1)  # and the channel still works
        assert get(server.url, "/weights/checksum")["digest"] == weights_digest(named)
    finally:
        sender.close()


def test_commit_to_a_server_that_died_fails_soon_naming_it(monkeypatch):
    """A server killed while the sender commits refuses connections: the commit gives up after
    control.UNREACHABLE_S (naming the server) instead of polling until the whole commit timeout."""
    import time

    from weight_sync import control
    from weight_sync.errors import WeightSyncError
    from weight_sync.protocol import CommitRequest

    with socket.socket() as s:  # a port nobody listens on: connection refused, as after a SIGKILL
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(control, "UNREACHABLE_S", 0.5)
    client = control.ControlClient(url, "token", timeout=120)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="unreachable") as e:
        client.commit(CommitRequest(version=3, run_id="run-a"))
    assert time.monotonic() - t0 < 10 and url in str(e.value)
    client.close()
