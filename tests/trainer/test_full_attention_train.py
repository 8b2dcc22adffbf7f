"""TraceRL / DiPO on a full-attention (LLaDA / Dream-layout) policy from its traces: the real `trainer.loop.learn`
step (rewards, advantages, full-attention replay rows, DeepSpeed updates) in-process, the behaviour
log-probs taken from the sampler (exact mode: the trainer's replay reproduces them; prefix-cache mode: the
mismatch is measured and the TIS / MIS corrections see it), the value model on both families. Two ranks making
the same update as one: test_ranks.py (the `full` and `dream` cases of ranks_worker.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.trainer.ranks_worker import global_rollouts, make_policy, run_case

FAMILY = {"llada": "full", "dream": "dream"}  # ranks_worker's family of each model family


def _changed(result: dict, family: str = "llada") -> bool:
    initial = dict(make_policy(FAMILY[family]).hf_named_tensors())
    return any(not torch.equal(p, initial[n]) for n, p in result["policy"].items())


def test_tracerl_exact_mode_replays_the_sampler_and_trains(one_rank: Any) -> None:
    rollouts = global_rollouts(make_policy("full"), "full", "exact")
    assert all(r.trace.cache_mode == "exact" for r in rollouts)
    out = run_case(one_rank, "full", "tracerl", 0, rollouts)
    m = out["metrics"]
    assert m["num_samples"] == 16 and m["num_rows"] > 16  # one row per trace step of every sample
    assert m["mismatch_abs_max"] < 1e-4  # behaviour log-probs of the sampler == the trainer's replay
    assert _changed(out) and "pg_loss" in m


@pytest.mark.parametrize(("horizon", "correction"), [(-1, "tis"), (0, "tis"), (0, "mis")])
def test_prefix_cache_rollouts_show_a_mismatch_that_tis_corrects(one_rank: Any, horizon: int, correction: str) -> None:
    """The prefix cache with the official horizon (128: the whole tiny canvas) or horizon 0 (a block's later
    forwards see the prefix and the block only: the replay rows see the same), corrected by TIS or MIS."""
    rollouts = global_rollouts(make_policy("full"), "full", "prefix", further_horizon=horizon)
    assert all(r.trace.cache_mode == "prefix" and r.trace.further_horizon == (128 if horizon < 0 else 0)
               for r in rollouts)
    out = run_case(one_rank, "full", "tracerl", 0, rollouts, is_correction=correction, is_cap=2.0)
    m = out["metrics"]
    assert m["mismatch_abs_max"] > 1e-6  # the prefix cache's stale K/V, measured per token
    assert "is_weight_mean" in m and m["is_weight_mean"] != pytest.approx(1.0, abs=1e-9)  # the weights see it
    assert _changed(out)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_value_model_with_stepwise_gae_trains_both(one_rank: Any, family: str) -> None:
    """TraceRL with the value model on LLaDA / Dream rollouts: values over the replay rows, step-wise GAE over
    the trace's steps, the value model and the policy both updated."""
    fam = FAMILY[family]
    rollouts = global_rollouts(make_policy(fam), fam, "exact")
    out = run_case(one_rank, fam, "tracerl", 0, rollouts, use_value_model=True, lam=0.95)
    m = out["metrics"]
    assert {"value_loss", "explained_var"} <= set(m) and m["mismatch_abs_max"] < 1e-4
    assert _changed(out, family)
    start = make_policy(fam)
    changed = [n for n, p in out["value"].items() if n.startswith("backbone.") and
               not torch.equal(p, dict(start.named_parameters())[n.removeprefix("backbone.")])]
    assert changed and out["value"]["v_head.weight"].abs().sum() > 0  # the value model learned too


@pytest.mark.parametrize("objective", ["dipo", "random_masking"])
def test_other_objectives_train_a_full_attention_policy(one_rank: Any, objective: str) -> None:
    extra = {"kl_coef": 0.1} if objective == "dipo" else {}
    out = run_case(one_rank, "full", objective, 0, global_rollouts(make_policy("full"), "full", "exact"), **extra)
    assert _changed(out) and out["metrics"]["num_rows"] > 0
    if objective == "dipo":
        assert "kl_ref" in out["metrics"]
