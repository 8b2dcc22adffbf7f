"""Unit tests of the official LLaDA / Dream decoding rules (no model): transfer schedules, the prefix window,
the sampling distribution's filter order, the ranking rule and the commit rule."""

from __future__ import annotations

import pytest
import torch

from dllm.full.sampler import commit_full, confidence, full_sampling_logprobs, official_topk
from dllm.full.schedule import (
    AUTO_HORIZON,
    dream_schedule,
    family_schedule,
    llada_schedule,
    resolve_horizon,
    schedule_name,
    window_end,
)
from dllm.sampling import SamplingParams
from dllm.strategy import Strategy


def test_llada_schedule_is_get_num_transfer_tokens() -> None:
    assert llada_schedule(32, 32) == [1] * 32
    assert llada_schedule(5, 2) == [3, 2] and llada_schedule(8, 3) == [3, 3, 2]  # the first `rem` steps one more
    assert family_schedule("llada", 4, 4) == [1, 1, 1, 1]


def test_dream_schedule_is_the_timestep_rule_with_eps() -> None:
    assert dream_schedule(8, 8) == [1, 0, 1, 1, 1, 1, 1, 2]  # the worked example
    assert dream_schedule(32, 32) == [1, 0] + [1] * 29 + [2]  # configs/rl_dream.yaml: block 32, 32 steps
    assert dream_schedule(4, 4) == [1, 0, 1, 2] and dream_schedule(8, 3) == [1, 3, 4]
    assert dream_schedule(4, 1) == [1, 3] and dream_schedule(1, 4) == [1]  # one step: first token, then the rest
    for n, steps in ((16, 5), (32, 7), (9, 9)):
        s = dream_schedule(n, steps)
        assert s[0] == 1 and sum(s) == n and len(s) == steps
    assert dream_schedule(8, 8, eps=0.5) != dream_schedule(8, 8)  # eps moves the timesteps
    assert schedule_name("dream") == "dream eps=0.001" and schedule_name("llada") == "llada"


def test_prefix_window_and_horizon() -> None:
    assert window_end(40, 300, 128) == 168 and window_end(40, 100, 128) == 100 and window_end(40, 300, None) == 300
    assert window_end(40, 300, 0) == 40  # horizon 0: the block alone
    assert resolve_horizon("llada", AUTO_HORIZON) == 128 and resolve_horizon("dream", AUTO_HORIZON) == 32
    assert resolve_horizon("dream", None) is None and resolve_horizon("dream", 7) == 7
    with pytest.raises(ValueError, match="further_horizon"):
        resolve_horizon("llada", -2)


def test_top_p_comes_before_top_k() -> None:
    """Dream's sample_tokens: top-p over the whole distribution, then top-k (the other order differs)."""
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -9.0]])
    p = SamplingParams(temperature=1.0, top_p=0.5, top_k=2)
    kept = torch.isfinite(full_sampling_logprobs(logits, p, mask_id=5)).tolist()[0]
    assert kept == [True, True, False, False, False, False]
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=2)
    assert torch.isfinite(full_sampling_logprobs(logits, p, mask_id=5)).sum() == 2
    assert not torch.isfinite(full_sampling_logprobs(logits, SamplingParams(), mask_id=0)[0, 0])  # mask id excluded


def test_llada_ranks_by_the_untempered_probability() -> None:
    logits = torch.tensor([[[4.0, 0.0, 0.0], [2.0, 1.9, 1.8]]])  # position 0 sure, position 1 not
    ids = torch.tensor([[1, 0]])  # the sampled tokens: an unlikely one at 0, the likely one at 1
    x = logits / 4.0  # a high temperature flattens both
    lp = torch.log_softmax(x, -1).gather(-1, ids[..., None]).squeeze(-1)
    official = confidence(logits, x, lp, ids, mask_id=2, family="llada", ranking="official")
    tempered = confidence(logits, x, lp, ids, mask_id=2, family="llada", ranking="tempered")
    raw = torch.softmax(logits[..., :2], -1)
    torch.testing.assert_close(official, raw.gather(-1, ids[..., None]).squeeze(-1).double())
    torch.testing.assert_close(tempered, lp.exp())
    assert official.dtype == torch.float64  # as the official `softmax(logits.to(float64))`
    dream = confidence(logits, x, lp, ids, mask_id=2, family="dream", ranking="official")
    torch.testing.assert_close(dream, lp.exp())  # Dream ranks by the distribution it sampled from


def test_commit_rules() -> None:
    conf = torch.tensor([[0.2, 0.9, 0.5, 0.95], [0.1, 0.3, 0.2, 0.25], [0.5, 0.5, 0.5, 0.5]])
    masked = torch.tensor([[True, True, True, False], [True] * 4, [False, True, True, True]])
    k, thr = torch.tensor([2, 2, 2]), torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    static = commit_full(conf, masked, k, thr, torch.full((3,), Strategy.static.code))
    assert static.tolist() == [[False, True, True, False], [False, True, False, True], [False, True, True, False]]
    dyn = commit_full(conf, masked, k, thr, torch.full((3,), Strategy.dynamic.code))
    # >= threshold (0.5 counts), else the single most confident: at least one, whatever k says
    assert dyn.tolist() == [[False, True, True, False], [False, True, False, False], [False, True, True, True]]
    seq = commit_full(conf, masked, k, thr, torch.full((3,), Strategy.sequential.code))
    assert seq.tolist() == [[True, True, False, False], [True, True, False, False], [False, True, True, False]]


def test_official_topk_breaks_ties_as_torch_topk_of_the_official_width() -> None:
    conf = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    masked = torch.tensor([[False, True, True, True]])
    k, code = torch.tensor([1]), torch.tensor([Strategy.static.code])
    lowest = commit_full(conf, masked, k, torch.zeros(1, dtype=torch.float64), code)
    assert lowest.tolist() == [[False, True, False, False]]  # dlrl's rule: the lower position
    for width in (4, 8, 64):
        v = torch.full((width,), float("-inf"))
        v[1:4] = 1.0
        want = torch.topk(v, 1).indices.item()
        got = official_topk(lowest, conf, masked, k, code, [(width, 0)])
        assert got[0].nonzero().flatten().tolist() == [want]
