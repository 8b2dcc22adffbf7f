"""deploy/local/run.sh end to end: 2 real `dlrl serve` processes and a 2-rank trainer under
torchrun (the commands the manifests use) for 2 steps on a tiny random model. Both servers end at
the trainer's last version holding exactly its final weights, and the script stops them (SIGTERM,
exit 0) before it exits 0.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
from pathlib import Path

import httpx
import pytest

from dllm.weights import load_pretrained
from tests.helpers import run_group
from weight_sync import weights_digest

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "deploy" / "local" / "run.sh"
pytestmark = pytest.mark.slow


def free_port_pair() -> int:
    """A port P with P and P + 1 free on loopback (the script's servers listen on P, P + 1)."""
    for _ in range(200):
        base = random.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def test_two_servers_and_two_ranks_end_on_the_trainers_weights(tiny_model_dir, tmp_path):
    out, port = tmp_path / "local", free_port_pair()
    env = {k: v for k, v in os.environ.items() if k != "DLRL_ADMIN_TOKEN"}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))  # as `make test`: DeepSpeed's op
    cmd = ["bash", str(LOCAL), "--model", tiny_model_dir, "--steps", "2", "--out", str(out), "--port", str(port),
           "--device", "cpu", "--", "train.prompts_per_step=4", "train.group_size=4", "train.max_tokens=6",
           "train.eval_every=0", "train.tensorboard=false", "train.reward=tests.helpers:parity_reward"]
    done = run_group(cmd, timeout=600, env=env)
    logs = "\n".join(p.read_text()[-2000:] for p in out.glob("server-*.log"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs

    summary = json.loads(done.stdout[done.stdout.index("{\n  \"final_model\""):done.stdout.index("}\n") + 1])
    assert summary["num_ranks"] == 2
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    final = weights_digest(load_pretrained(out / "run" / "final").hf_named_tensors())
    assert final != weights_digest(load_pretrained(tiny_model_dir).hf_named_tensors())  # it trained
    servers = json.loads((out / "servers.json").read_text())
    assert sorted(servers) == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    for url, state in servers.items():
        assert state == {"version": rows[-1]["version"], "digest": final}, url
        with pytest.raises(httpx.HTTPError):  # stopped by the script
            httpx.get(url + "/health", timeout=2)
