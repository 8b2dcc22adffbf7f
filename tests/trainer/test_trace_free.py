"""Trace-free rollouts through the real trainer: a real server with its traces withheld
(`server.trace_free=true`, what server.backend=lmdeploy gives) trains random-masking RL end to
end, and the trainer's `learn` refuses them for trace replay with an error naming the backend
and the objectives that work."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from dllm.trace import Trace
from dllm.weights import load_pretrained
from rollout_client.protocol.native import Sample
from rollout_client.protocol.rollout import Rollout
from tests.helpers import write_train_config
from trainer.infra.dist import Ranks
from trainer.loop import learn, trace_free_problem
from weight_sync import weights_digest

TOKEN = "trace-free-token"


@pytest.fixture(scope="module")
def served(make_server) -> str:
    return make_server(max_batch=16, trace_free=True, admin_token=TOKEN).url


def admin(url: str, path: str) -> dict:
    return httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()


def run_train(config, *overrides: str) -> int:
    from trainer.cli import main
    return main(["--config", str(config), *overrides])


def test_withheld_traces_are_published_trace_free(served):
    r = httpx.post(served + "/generate", json={"prompt": "1+2=", "max_tokens": 8, "temperature": 1.0}, timeout=60)
    tr = r.json()["samples"][0]["trace"]
    assert tr["trace_free"] is True and set(tr["steps"]) <= {0} and set(tr["logprobs"]) <= {0.0}


def test_random_masking_trains_from_trace_free_rollouts(served, tiny_model_dir, tmp_path):
    v0 = admin(served, "/weights/version")["version"]
    cfg = write_train_config(tmp_path, [served], tiny_model_dir, TOKEN, num_steps=1, prompts_per_step=2,
                             group_size=2)
    assert run_train(cfg, "objective=random_masking") == 0
    final = load_pretrained(tmp_path / "run" / "final")
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["num_rows"] > 0 and "pg_loss" in row
    assert admin(served, "/weights/version")["version"] == row["version"] in (v0 + 1, v0 + 2)
    assert admin(served, "/weights/checksum")["digest"] == weights_digest(final.hf_named_tensors())


def test_learn_refuses_trace_free_rollouts_for_trace_replay(served):
    r = httpx.post(served + "/generate", json={"prompt": ["1+2=", "3+4="], "max_tokens": 6}, timeout=60)
    rolls = [Rollout.from_sample(Sample.model_validate(s), 0, 1, served) for s in r.json()["samples"]]
    run = SimpleNamespace(cfg=SimpleNamespace(objective="tracerl", use_value_model=False), ranks=Ranks())
    with pytest.raises(ValueError) as e:
        learn(run, SimpleNamespace(rollouts=rolls), 0)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "train.objective=tracerl needs decoding traces" in msg and "backend 'native'" in msg
    assert "train.objective in (coupled, random_masking)" in msg


def rollout(trace_free: bool, backend: str = "") -> Rollout:
    tr = Trace(prompt_len=2, block_size=4, steps=[0, 0], logprobs=[0.0, 0.0], trace_free=trace_free, backend=backend)
    return Rollout(prompt_index=0, sample_index=0, prompt_ids=[1, 2], completion_ids=[3, 4], text="",
                   finish_reason="stop", version=0, trace=tr)


@pytest.mark.parametrize("objective,value_model,refused", [
    ("tracerl", False, True), ("dipo", False, True), ("random_masking", False, False),
    ("coupled", False, False), ("coupled", True, True),
])
def test_which_objectives_need_a_trace(objective, value_model, refused):
    cfg = SimpleNamespace(objective=objective, use_value_model=value_model)
    problem = trace_free_problem(cfg, [rollout(False), rollout(True, "lmdeploy")])  # type: ignore[arg-type]
    assert (problem is not None) == refused
    if refused:
        assert "'lmdeploy'" in problem and "(coupled, random_masking)" in problem
        assert ("train.use_value_model=true" in problem) == value_model
    assert trace_free_problem(cfg, [rollout(False)]) is None  # type: ignore[arg-type]
