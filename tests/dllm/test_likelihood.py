"""Prompt log-likelihoods (dllm.likelihood) against naive references, one dense forward per state.

    python -m pytest -q tests/dllm/test_likelihood.py
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dllm.likelihood import elbo_logprobs, sequential_logprobs
from dllm.model import SDARForCausalLM
from tests.helpers import tiny_config

BS, MASK = 4, 63


@pytest.fixture(scope="module")
def model() -> SDARForCausalLM:
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config()).eval()


def state_logprobs(model: SDARForCausalLM, state: list[int]) -> torch.Tensor:
    """The dense block-causal forward of one state (padded with masks to its block's end) ->
    log-softmax [L, V] with the mask token excluded, fp32."""
    L = math.ceil(len(state) / BS) * BS
    ids = torch.tensor([state + [MASK] * (L - len(state))])
    with torch.no_grad():
        logits = model(ids, torch.arange(L)[None]).float()[0]
    logits[:, MASK] = float("-inf")
    return torch.log_softmax(logits, -1)


def brute_sequential(model: SDARForCausalLM, ids: list[int]) -> list[float]:
    """One forward per token p >= 1: x_<p visible, p to the end of its block masked."""
    return [float(state_logprobs(model, ids[:p] + [MASK])[p, ids[p]]) for p in range(1, len(ids))]


TEXTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 2], [30, 31, 32, 33], [7, 8, 9, 10, 11, 12, 40]]


def test_sequential_equals_one_forward_per_token(model: SDARForCausalLM) -> None:
    scores = sequential_logprobs(model, TEXTS, top_k=3, max_row_tokens=16)  # several chunks of rows
    for ids, s in zip(TEXTS, scores):
        assert s.logprobs[0] is None and len(s.logprobs) == len(ids)
        ref = brute_sequential(model, ids)
        assert max(abs(a - b) for a, b in zip(s.logprobs[1:], ref)) < 1e-4  # type: ignore[operator]
        assert s.num_rows == len({p % BS for p in range(1, len(ids))})  # one row per offset with a target
        assert s.top is not None and s.top[0] == [] and all(len(t) == 3 for t in s.top[1:])
        for p in range(1, len(ids)):  # top-k: the most likely tokens of the same state
            full = state_logprobs(model, ids[:p] + [MASK])[p]
            assert [t for t, _ in s.top[p]] == torch.topk(full, 3).indices.tolist()
    alone = sequential_logprobs(model, [TEXTS[0]])[0].logprobs  # batching changes nothing
    assert max(abs(a - b) for a, b in zip(alone[1:], scores[0].logprobs[1:])) < 1e-5  # type: ignore[operator]


def order_average(model: SDARForCausalLM, ids: list[int]) -> tuple[float, float]:
    """For a text of one block after token 0: (mean over decoding orders of the order's log-likelihood =
    the ELBO's expectation, log of the mean over orders of the order's likelihood)."""
    scored = list(range(1, len(ids)))
    logs = []
    for order in itertools.permutations(scored):
        state, total = list(ids[:1]) + [MASK] * len(scored), 0.0
        for p in order:
            total += float(state_logprobs(model, state)[p, ids[p]])
            state[p] = ids[p]
        logs.append(total)
    return sum(logs) / len(logs), math.log(sum(math.exp(v) for v in logs) / len(logs))


def test_elbo_is_seeded_and_estimates_the_order_average(model: SDARForCausalLM) -> None:
    ids = [3, 17, 29, 41]  # one block: 3 scored tokens, 6 orders
    a = elbo_logprobs(model, [ids], num_samples=8, seed=1)[0].logprobs
    assert a == elbo_logprobs(model, [ids], num_samples=8, seed=1)[0].logprobs  # reproducible
    assert a != elbo_logprobs(model, [ids], num_samples=8, seed=2)[0].logprobs
    expected, log_mean = order_average(model, ids)
    assert expected <= log_mean  # the ELBO's expectation bounds the order-averaged likelihood (Jensen)
    draws = [sum(v for v in s.logprobs[1:] if v is not None)  # 300 independent one-sample estimates
             for s in elbo_logprobs(model, [ids] * 300, num_samples=1, seed=3)]
    mean = sum(draws) / len(draws)
    se = math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1) / len(draws))
    assert abs(mean - expected) < 5 * se + 1e-6, (mean, expected, se)
    assert all(d <= 0 for d in draws)


def test_elbo_of_one_scored_token_per_block_is_exact(model: SDARForCausalLM) -> None:
    """A block with one scored token always masks it with weight 1: the sequential logprob, exactly."""
    ids = [9, 10, 11, 12, 13]  # block 0: tokens 1..3 (three), block 1: token 4 alone
    elbo = elbo_logprobs(model, [ids], num_samples=3, seed=0)[0].logprobs
    seq = sequential_logprobs(model, [ids])[0].logprobs
    assert abs(elbo[4] - seq[4]) < 1e-5  # type: ignore[operator]
    two = [9, 10]  # token 1 is the only scored one
    assert abs(elbo_logprobs(model, [two], 5)[0].logprobs[1] - sequential_logprobs(model, [two])[0].logprobs[1]) < 1e-5  # type: ignore[operator]
