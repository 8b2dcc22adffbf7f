"""TraceRL / DiPO on a full-attention (LLaDA-layout) policy from its traces: the real `trainer.loop.learn`
step (rewards, advantages, full-attention replay rows, DeepSpeed updates) in-process, the behaviour
log-probs taken from the sampler (exact mode: the trainer's replay reproduces them; prefix-cache mode: the
mismatch is measured and the TIS correction sees it), and two ranks making the same update as one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.full_ranks_worker import CASES, global_rollouts, make_policy, run_case

WORKER = Path(__file__).with_name("full_ranks_worker.py")


@pytest.fixture(scope="module")
def ranks() -> Any:
    from trainer.infra.dist import Ranks

    return Ranks.init()


def _changed(result: dict, family: str = "llada") -> bool:
    initial = dict(make_policy(family).hf_named_tensors())
    return any(not torch.equal(p, initial[n]) for n, p in result["policy"].items())


def test_tracerl_exact_mode_replays_the_sampler_and_trains(ranks: Any) -> None:
    rollouts = global_rollouts(make_policy(), "exact")
    assert all(r.trace.cache_mode == "exact" for r in rollouts)
    out = run_case(ranks, "tracerl", 0, rollouts)
    m = out["metrics"]
    assert m["num_samples"] == 16 and m["num_rows"] > 16  # one row per trace step of every sample
    assert m["mismatch_abs_max"] < 1e-4  # behaviour log-probs of the sampler == the trainer's replay
    assert _changed(out) and "pg_loss" in m


@pytest.mark.parametrize(("horizon", "correction"), [(-1, "tis"), (0, "tis"), (0, "mis")])
def test_prefix_cache_rollouts_show_a_mismatch_that_tis_corrects(ranks: Any, horizon: int, correction: str) -> None:
    """The prefix cache with the official horizon (128: the whole tiny canvas) or horizon 0 (a block's later
    forwards see the prefix and the block only: the replay rows see the same), corrected by TIS or MIS."""
    rollouts = global_rollouts(make_policy(), "prefix", further_horizon=horizon)
    assert all(r.trace.cache_mode == "prefix" and r.trace.further_horizon == (128 if horizon < 0 else 0)
               for r in rollouts)
    out = run_case(ranks, "tracerl", 0, rollouts, is_correction=correction, is_cap=2.0)
    m = out["metrics"]
    assert m["mismatch_abs_max"] > 1e-6  # the prefix cache's stale K/V, measured per token
    assert "is_weight_mean" in m and m["is_weight_mean"] != pytest.approx(1.0, abs=1e-9)  # the weights see it
    assert _changed(out)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_value_model_with_stepwise_gae_trains_both(ranks: Any, family: str) -> None:
    """TraceRL with the value model on LLaDA / Dream rollouts: values over the replay rows, step-wise GAE over
    the trace's steps, the value model and the policy both updated."""
    rollouts = global_rollouts(make_policy(family), "exact")
    out = run_case(ranks, "tracerl", 0, rollouts, family=family, use_value_model=True, lam=0.95)
    m = out["metrics"]
    assert {"value_loss", "explained_var"} <= set(m) and m["mismatch_abs_max"] < 1e-4
    assert _changed(out, family)
    start = make_policy(family)
    changed = [n for n, p in out["value"].items() if n.startswith("backbone.") and
               not torch.equal(p, dict(start.named_parameters())[n.removeprefix("backbone.")])]
    assert changed and out["value"]["v_head.weight"].abs().sum() > 0  # the value model learned too


@pytest.mark.parametrize("objective", ["dipo", "random_masking"])
def test_other_objectives_train_a_full_attention_policy(ranks: Any, objective: str) -> None:
    extra = {"kl_coef": 0.1} if objective == "dipo" else {}
    out = run_case(ranks, objective, 0, global_rollouts(make_policy(), "exact"), **extra)
    assert _changed(out) and out["metrics"]["num_rows"] > 0
    if objective == "dipo":
        assert "kl_ref" in out["metrics"]


@pytest.mark.slow
def test_two_ranks_make_the_same_update_as_one(ranks: Any, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(WORKER.parents[2]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name, objective, stage, mode, options in CASES:
        family = options.get("family", "llada")
        one = run_case(ranks, objective, stage, global_rollouts(make_policy(family), mode), **options)
        two = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        for part in ("policy", "value") if "value" in one else ("policy",):  # Dream and the value model too
            for n, p in one[part].items():
                assert (p - two[part][n]).abs().max() <= 1e-5, (name, part, n)
        assert _changed(one, family)
        for key, value in one["metrics"].items():  # metrics use global counts
            assert two["metrics"][key] == pytest.approx(value, abs=1e-5), (name, key)
