"""The trainer crashed on purpose (real SIGKILL at chosen points, DLRL_FAULT) and resumed, and a
server restarted under a running trainer: no step lost or applied twice, versions strictly
increasing, servers ending with exactly the trainer's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dllm.weights import load_pretrained
from tests.helpers import admin_get, run_group, start_server_process, wait_until, write_train_config
from weight_sync import weights_digest

TOKEN = "crash-token"
pytestmark = pytest.mark.slow


def write_config(tmp: Path, servers: list[str], model: str, **train) -> Path:
    return write_train_config(tmp, servers, model, TOKEN, **{"num_steps": 5, "checkpoint_every": 1, **train})


def train(config: Path, *overrides: str, fault: str = "", wait: bool = True):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), DLRL_FAULT=fault)
    cmd = [sys.executable, "-m", "dlrl.cli", "train", "--config", str(config), *overrides]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return run_group(cmd, timeout=600, env=env)


def rows(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    srv = start_server_process(tiny_model_dir, TOKEN, tmp_path, "server.weight_sync_lease_s=5")
    yield srv
    srv.kill(signal.SIGTERM)


def test_kill_9_in_rollouts_optimizer_and_push_then_resume(server, tiny_model_dir, tmp_path):
    cfg = write_config(tmp_path, [server.url], tiny_model_dir)
    for n, fault in enumerate(("rollout:2", "optimizer:3", "push:4")):
        done = train(cfg, *(["--resume"] if n else []), fault=fault)
        assert done.returncode == -signal.SIGKILL, (fault, done.stderr[-2000:])
        assert max(r["step"] for r in rows(tmp_path)) == int(fault.split(":")[1]) - 1  # the crashed step left no row
    done = train(cfg, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r["step"] for r in rows(tmp_path)]
    assert steps == [1, 2, 3, 4, 5]  # every step exactly once
    versions = [r["version"] for r in rows(tmp_path)]
    assert versions == sorted(set(versions))  # strictly increasing over three crashes
    final = weights_digest(load_pretrained(tmp_path / "run" / "final").hf_named_tensors())
    assert admin_get(server.url, "/weights/checksum", TOKEN)["digest"] == final
    assert admin_get(server.url, "/weights/version", TOKEN)["version"] == versions[-1]


def test_a_restarted_server_is_detected_and_resynced(tiny_model_dir, tmp_path):
    srv = start_server_process(tiny_model_dir, TOKEN, tmp_path)
    port = int(srv.url.rsplit(":", 1)[1])
    # 12 steps: the server is killed as soon as 2 are logged, long before the run can end; the trainer waits for
    # it (server_wait_s), tells the restart apart and re-syncs it, and pushes the steps left to it
    cfg = write_config(tmp_path, [srv.url], tiny_model_dir, num_steps=12, checkpoint_every=0, server_wait_s=120)
    proc = train(cfg, wait=False)
    try:
        jsonl = tmp_path / "run" / "metrics.jsonl"
        wait_until(lambda: jsonl.is_file() and len(jsonl.read_text().splitlines()) >= 2, 300, "two steps")
        srv.kill(signal.SIGKILL)  # the server dies and comes back with its original weights, version 0
        srv = start_server_process(tiny_model_dir, TOKEN, tmp_path, port=port)
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "restarted" in err and srv.url in err  # a clear log line naming it
        final = weights_digest(load_pretrained(tmp_path / "run" / "final").hf_named_tensors())
        assert admin_get(srv.url, "/weights/checksum", TOKEN)["digest"] == final
        assert admin_get(srv.url, "/weights/version", TOKEN)["version"] == rows(tmp_path)[-1]["version"]
        assert rows(tmp_path)[-1]["step"] == 12
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.kill(signal.SIGTERM)


def test_a_server_restarted_between_data_and_commit_is_told_apart_and_pushed_again(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """The server dies after the data plane and is back (same port, version 0) before the commit
    arrives: the commit does not fail as a bad update but names the restart (FleetError.restarted,
    which `_push_through_restarts` waits out), and pushing the version again applies it."""
    from trainer.infra.fleet import FleetError, ServerFleet
    from weight_sync import WeightSender

    srv = start_server_process(tiny_model_dir, TOKEN, tmp_path)
    port = int(srv.url.rsplit(":", 1)[1])
    named = {n: t + 0.01 for n, t in load_pretrained(tiny_model_dir).hf_named_tensors()}
    servers = [srv]
    commit_all = WeightSender._commit_all

    def restart_then_commit(self, body):
        servers[-1].kill(signal.SIGKILL)
        servers.append(start_server_process(tiny_model_dir, TOKEN, tmp_path, port=port))
        return commit_all(self, body)

    fleet = ServerFleet([srv.url], TOKEN, timeout=60)
    try:
        monkeypatch.setattr(WeightSender, "_commit_all", restart_then_commit)
        with pytest.raises(FleetError, match="restarted during the commit of version 1") as e:
            fleet.push(named, 1)
        assert e.value.restarted == [srv.url]
        assert admin_get(srv.url, "/weights/version", TOKEN)["version"] == 0  # nothing applied
        monkeypatch.setattr(WeightSender, "_commit_all", commit_all)
        fleet.push(named, 1)
        assert admin_get(srv.url, "/weights/version", TOKEN)["version"] == 1
        assert admin_get(srv.url, "/weights/checksum", TOKEN)["digest"] == weights_digest(named)
    finally:
        fleet.close()
        servers[-1].kill(signal.SIGTERM)
