"""End to end with real processes: `dlrl train nproc=2` (two trainer ranks under torchrun)
against two real `dlrl serve` processes; checkpoint + `--resume` with two ranks; a server
killed mid-run; SIGTERM / SIGKILL of a trainer that started its own server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dllm.weights import load_pretrained
from tests.helpers import (
    admin_get,
    free_port,
    run_group,
    shm_left_behind,
    start_server_processes,
    wait_until,
    write_train_config,
)
from weight_sync import weights_digest

TOKEN = "ranks-token"
pytestmark = pytest.mark.slow


def write_config(tmp: Path, servers: list[str], model: str, **train) -> Path:
    return write_train_config(tmp, servers, model, TOKEN, **{"record_digests": True, **train})


def train_cmd(config: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "dlrl.cli", "train", "--config", str(config), *overrides]


def run_train(config: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return run_group(train_cmd(config, *overrides), timeout, env=env)


def metrics(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def pushed_digests(tmp: Path) -> dict[int, str]:
    return {r["version"]: r["digest"] for r in map(json.loads, (tmp / "run" / "versions.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def shared_servers(tiny_model_dir, tmp_path_factory):
    """Two servers for the tests that leave them running (each run first syncs them to its own starting weights,
    and the tests compare versions and digests with what that run logged, not with a fresh server's)."""
    servers = start_server_processes(2, tiny_model_dir, TOKEN, tmp_path_factory.mktemp("servers"))
    yield servers
    for s in servers:
        s.kill(signal.SIGTERM)


@pytest.fixture
def two_servers(tiny_model_dir, tmp_path):
    """Two servers of this test alone (it kills one)."""
    servers = start_server_processes(2, tiny_model_dir, TOKEN, tmp_path)
    yield servers
    for s in servers:
        s.kill(signal.SIGTERM)


def test_two_ranks_two_servers_then_resume(shared_servers, tiny_model_dir, tmp_path):
    urls = [s.url for s in shared_servers]
    cfg = write_config(tmp_path, urls, tiny_model_dir, checkpoint_every=1)
    done = run_train(cfg, "nproc=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout[done.stdout.index("{"):])["num_ranks"] == 2
    final = weights_digest(load_pretrained(tmp_path / "run" / "final").hf_named_tensors())
    for url in urls:  # both servers at the same version, holding exactly the trainer's weights
        assert admin_get(url, "/weights/version", TOKEN)["version"] == metrics(tmp_path)[-1]["version"]
        assert admin_get(url, "/weights/checksum", TOKEN)["digest"] == final
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]

    done = run_train(cfg, "nproc=2", "num_steps=3", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    versions = [r["version"] for r in rows]
    assert versions == sorted(set(versions))  # strictly increasing across the resume
    final = weights_digest(load_pretrained(tmp_path / "run" / "final").hf_named_tensors())
    for url in urls:
        assert admin_get(url, "/weights/checksum", TOKEN)["digest"] == final


def test_deepspeed_launcher_then_resume_with_another_number_of_ranks_is_refused(shared_servers, tiny_model_dir,
                                                                                tmp_path):
    cfg = write_config(tmp_path, [shared_servers[0].url], tiny_model_dir, checkpoint_every=1, num_steps=1,
                       zero_stage=2)
    # a free rendezvous port: DeepSpeed's default (29500) also names its shared-memory buffers, which another
    # job on the machine using the default would share
    deepspeed = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", str(free_port()),
                 "--module"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), DS_ACCELERATOR="cpu")
    done = run_group(deepspeed + train_cmd(cfg)[2:], timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"num_ranks": 2' in done.stdout
    done = run_train(cfg, "num_steps=2", "--resume")  # refused before anything starts (issue 47)
    assert done.returncode == 2 and "nproc=2" in done.stderr and "ZeRO-2" in done.stderr


def test_a_server_killed_mid_run_stops_the_run_naming_it(two_servers, tiny_model_dir, tmp_path):
    a, b = two_servers
    cfg = write_config(tmp_path, [a.url, b.url], tiny_model_dir, num_steps=500, server_wait_s=3)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(train_cmd(cfg, "nproc=2"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        jsonl = tmp_path / "run" / "metrics.jsonl"
        wait_until(lambda: jsonl.is_file() and len(jsonl.read_text().splitlines()) >= 2, 300, "two steps")
        b.kill(signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and b.url in err, err[-3000:]
    state = admin_get(a.url, "/weights/version", TOKEN)
    assert state["update"] is None or state["update"]["phase"] == "receiving"  # nothing half-applied
    digest = admin_get(a.url, "/weights/checksum", TOKEN)["digest"]
    assert digest == pushed_digests(tmp_path)[state["version"]]  # one pushed version, in full


def test_sigterm_checkpoints_stops_its_server_and_exits_zero(tiny_model_dir, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = write_config(tmp_path, [url], tiny_model_dir, num_steps=500, start_server=True)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(train_cmd(cfg, "server.device=cpu"), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    jsonl = tmp_path / "run" / "metrics.jsonl"
    wait_until(lambda: jsonl.is_file() and len(jsonl.read_text().splitlines()) >= 2, 300, "two steps")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM" in err and "--resume" in err
    last = metrics(tmp_path)[-1]["step"]
    tag = (tmp_path / "run" / "checkpoint" / "latest").read_text().strip()
    state = json.loads((tmp_path / "run" / "checkpoint" / tag / "client_state.json").read_text())
    # the last logged step, or the next one when the signal aborted its push (its update is kept)
    if tag == f"step{last + 1}":
        assert f"stopped by a signal during step {last + 1}" in err
    else:
        assert tag == f"step{last}"
    assert f"step{state['step']}" == tag
    with pytest.raises(httpx.HTTPError):  # the server it started is gone
        httpx.get(url + "/health", timeout=2)
    assert not shm_left_behind(shm_before)  # no shared-memory segment left behind


def test_servers_die_with_a_sigkilled_trainer(tiny_model_dir, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = write_config(tmp_path, [url], tiny_model_dir, num_steps=500, start_server=True)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(train_cmd(cfg, "server.device=cpu"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    jsonl = tmp_path / "run" / "metrics.jsonl"
    wait_until(lambda: jsonl.is_file() and len(jsonl.read_text().splitlines()) >= 1, 300, "one step")
    proc.kill()
    proc.wait()

    def gone() -> bool:
        try:
            httpx.get(url + "/health", timeout=1)
            return False
        except httpx.HTTPError:
            return True

    wait_until(gone, 30, "the orphaned server exits")
