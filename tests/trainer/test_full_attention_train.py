"""TraceRL / DiPO on a full-attention (LLaDA-layout) policy from its traces: the real `trainer.loop.learn`
step (rewards, advantages, full-attention replay rows, DeepSpeed updates) in-process, the behaviour
log-probs taken from the sampler (exact mode: the trainer's replay reproduces them; prefix-cache mode: the
mismatch is measured and the TIS correction sees it). Two ranks making the same update as one: test_ranks.py
(the `full` cases of ranks_worker.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.trainer.ranks_worker import global_rollouts, make_policy, run_case


def rollouts(cache_mode: str) -> list:
    return global_rollouts(make_policy("full"), "full", cache_mode)


def _changed(result: dict) -> bool:
    initial = dict(make_policy("full").hf_named_tensors())
    return any(not torch.equal(p, initial[n]) for n, p in result["policy"].items())


def test_tracerl_exact_mode_replays_the_sampler_and_trains(one_rank: Any) -> None:
    exact = rollouts("exact")
    assert all(r.trace.cache_mode == "exact" for r in exact)
    out = run_case(one_rank, "full", "tracerl", 0, exact)
    m = out["metrics"]
    assert m["num_samples"] == 16 and m["num_rows"] > 16  # one row per trace step of every sample
    assert m["mismatch_abs_max"] < 1e-4  # behaviour log-probs of the sampler == the trainer's replay
    assert _changed(out) and "pg_loss" in m


def test_prefix_cache_rollouts_show_a_mismatch_that_tis_corrects(one_rank: Any) -> None:
    prefix = rollouts("prefix")
    assert all(r.trace.cache_mode == "prefix" for r in prefix)
    out = run_case(one_rank, "full", "tracerl", 0, prefix, is_correction="tis", is_cap=2.0)
    m = out["metrics"]
    assert m["mismatch_abs_max"] > 1e-6  # the prefix cache's stale K/V, measured per token
    assert "is_weight_mean" in m and m["is_weight_mean"] != pytest.approx(1.0, abs=1e-9)  # the weights see it
    assert _changed(out)


@pytest.mark.parametrize("objective", ["dipo", "random_masking"])
def test_other_objectives_train_a_full_attention_policy(one_rank: Any, objective: str) -> None:
    extra = {"kl_coef": 0.1} if objective == "dipo" else {}
    out = run_case(one_rank, "full", objective, 0, rollouts("exact"), **extra)
    assert _changed(out) and out["metrics"]["num_rows"] > 0
    if objective == "dipo":
        assert "kl_ref" in out["metrics"]
