"""LLaDA's Monte Carlo ELBO for every split of a text (dllm/full/likelihood.py): the sum of the per-token values
from any token on is the paper's estimate for that split, within its reported standard error of the exact
expectation (enumerated here over every mask count and subset, on the canvas padded with masks to whole
blocks), exact where only one token is masked, seeded; LLaDA and Dream (shifted logits).

    python -m pytest -q tests/dllm/test_full_likelihood.py
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dllm.embedded.full_folders import build_full_folder
from dllm.full.likelihood import elbo_logprobs, mask_counts
from dllm.likelihood import prompt_logprobs
from dllm.weights import load_pretrained


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = build_full_folder(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    return load_pretrained(Path(folder), dtype=torch.float32).eval()


@torch.no_grad()
def _exact(model: Any, ids: list[int], split: int) -> float:
    """E over l ~ U{1..m} and the l-subsets of the suffix of (m / l) sum log p(masked | rest): the ELBO itself."""
    L, m, mask = len(ids), len(ids) - split, model.config.mask_token_id
    pad = -L % model.config.block_size  # the canvas: whole blocks, the tail masked
    total = 0.0
    for num in range(1, m + 1):
        subsets = list(itertools.combinations(range(split, L), num))
        for subset in subsets:
            x = torch.tensor([ids + [mask] * pad])
            x[0, list(subset)] = mask
            logits = model(x).float()[0]
            logits[:, mask] = float("-inf")
            lp = torch.log_softmax(logits, -1)
            total += (m / num) * sum(float(lp[i, ids[i]]) for i in subset) / len(subsets) / m
    return total


def test_suffix_sums_are_the_split_estimates(model: Any) -> None:
    ids = [5, 9, 12, 7, 20]
    (s,) = elbo_logprobs(model, [ids], num_samples=256, seed=1)
    assert s.logprobs[0] is None and s.stderr is not None and s.stderr[0] is None and s.num_samples == 256
    assert s.num_rows == (len(ids) - 1) * 256
    for p in range(1, len(ids)):
        estimate = sum(v for v in s.logprobs[p:] if v is not None)
        exact, se = _exact(model, ids, p), s.stderr[p]
        assert se is not None and abs(estimate - exact) <= 4 * se + 1e-6, (p, estimate, exact, se)
    last = _exact(model, ids, len(ids) - 1)  # one token masked: no randomness at all
    assert s.logprobs[-1] == pytest.approx(last, abs=1e-5) and s.stderr[-1] == pytest.approx(0.0, abs=1e-9)


def test_seeded_and_batched_alike(model: Any) -> None:
    a = elbo_logprobs(model, [[5, 9, 12], [7, 8]], num_samples=4, seed=7)
    b = elbo_logprobs(model, [[5, 9, 12], [7, 8]], num_samples=4, seed=7, max_row_tokens=3)  # one row per forward
    for x, y in zip(a, b):
        assert x.logprobs[0] is None and y.logprobs[0] is None
        assert x.logprobs[1:] == pytest.approx(y.logprobs[1:], abs=1e-6)
    c = elbo_logprobs(model, [[5, 9, 12], [7, 8]], num_samples=4, seed=8)
    assert a[0].logprobs != c[0].logprobs
    assert elbo_logprobs(model, [[5]], num_samples=4)[0].logprobs == [None]  # nothing to condition on


def test_the_servers_entry_refuses_sequential_for_full_attention(model: Any) -> None:
    with pytest.raises(ValueError, match="likelihood: full-attention models are scored by the Monte Carlo ELBO"):
        prompt_logprobs(model, [[5, 9, 12]], "sequential")
    (s,) = prompt_logprobs(model, [[5, 9, 12]], "elbo", num_samples=2, seed=0)
    assert all(math.isfinite(v) for v in s.logprobs[1:] if v is not None)


def test_mask_counts_are_llada_stratified() -> None:
    counts = mask_counts(10, 5, torch.Generator().manual_seed(0)).tolist()
    assert all(1 <= c <= 10 for c in counts) and len(set(counts)) == 5
    gaps = sorted((b - a) % 10 for a, b in zip(counts, counts[1:]))
    assert gaps == [2, 2, 2, 2]  # equally spaced (m / N = 2), wrapping around m
