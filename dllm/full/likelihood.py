"""Prompt log-likelihoods of full-attention diffusion LMs (LLaDA, Dream): the Monte Carlo ELBO the LLaDA
paper evaluates conditional likelihoods with, for every split of a text into context and continuation.

LLaDA's estimator (its `get_log_likelihood`, the paper's multiple-choice evaluation) of log p(y | c): the
context c stays clean; per sample, l of the m continuation tokens are masked uniformly at random (l ~ U{1..m},
stratified over the samples: l_j = ((k + j m / N) rounded - 1) mod m + 1 for one k ~ U{1..m}, as its
`forward_process`), and the sample is (m / l) * sum of log p(y_i | c, unmasked y) over the masked y_i; the
estimate is the mean over N samples, a lower bound of log p(y | c) in expectation (the masked-diffusion
ELBO). The canvas is the text padded with masks to whole blocks of the model's block size
(`server.block_size`), as the decoder's canvas is when it generates (blocks start at position 0 here): the
padding is never scored, so the estimate is that of "the text continues with y" (the reference, for
pre-trained models of any length, appends nothing; a model fine-tuned on block canvases, as the embedded
LLaDA default is, scores its own answers far better with the padding: 90% vs 72% on examples/lm_eval's
multiple choice after RL).

A scoring API (OpenAI `echo` + `logprobs`, lm-eval-harness's `local-completions`) sends context and
continuation as one text and sums the per-token values of the continuation: the server never learns
where the continuation starts. So the estimate is made for EVERY split p = 1..L-1 of the text (E_p:
tokens before p clean, the suffix from p masked as above), and token p's value is E_p - E_{p+1} (E_L = 0):
the sum of the values from any token p on is exactly E_p, the paper's estimate for that split. Each
token also gets the standard error of E_p (std of its N samples / sqrt N): the uncertainty of the sum a
harness takes from that token on. Token 0 has no value (None). The mask token is excluded from the
distribution (it is never sampled).

Cost: (L - 1) x N rows of L positions (to whole blocks) per text of L tokens (one forward per row; batched up to
`max_row_tokens` positions per forward): fine for multiple-choice items, heavy for long documents.

    scores = elbo_logprobs(model, [[5, 6, 7, 8]], num_samples=16, seed=0)   # dllm.likelihood.TokenScores
    scores[0].logprobs, scores[0].stderr        # [None, v1, v2, v3], [None, se(E_1), se(E_2), se(E_3)]
    python -m pytest -q tests/dllm/test_full_likelihood.py
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dllm.likelihood import HEAD_CHUNK, MAX_ROW_TOKENS, TokenScores


def mask_counts(m: int, num_samples: int, gen: torch.Generator) -> torch.Tensor:
    """LLaDA's stratified mask counts: N values in 1..m, equally spaced from a random start k ~ U{1..m}."""
    k = int(torch.randint(1, m + 1, (), generator=gen))
    x = torch.round(torch.linspace(float(k), k + (num_samples - 1) * (m / num_samples), num_samples)).long()
    return (x - 1) % m + 1  # [N]


def split_rows(ids: torch.Tensor, split: int, num_samples: int, mask_id: int,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The N noisy rows [N, L] of split `split` (tokens before it clean, l_j of the m = L - split suffix
    tokens masked at random) and their weights [N, L] (m / l_j at the masked positions, 0 elsewhere)."""
    L = ids.shape[0]
    m = L - split
    counts = mask_counts(m, num_samples, gen)
    noisy = ids.expand(num_samples, L).clone()
    weights = torch.zeros(num_samples, L, dtype=torch.float64)
    for j, num in enumerate(counts.tolist()):
        masked = split + torch.randperm(m, generator=gen)[:num]
        noisy[j, masked] = mask_id
        weights[j, masked] = m / num
    return noisy, weights


@torch.no_grad()
def _row_values(model: Any, ids: torch.Tensor, noisy: torch.Tensor, weights: torch.Tensor,
                max_row_tokens: int) -> torch.Tensor:
    """Each row's sample value sum_i w_i log p(x_i | row) over its scored positions (w_i > 0): [R] float64."""
    R, L = noisy.shape
    dev = model.device
    mask_id = model.config.mask_token_id
    out = torch.zeros(R, dtype=torch.float64)
    per_forward = max(1, max_row_tokens // L)
    pos = torch.arange(L, device=dev)
    for a in range(0, R, per_forward):
        rows = noisy[a:a + per_forward].to(dev)
        masked = (weights[a:a + per_forward] > 0).to(dev)  # [r, L]: the masked text tokens (not the padding)
        hidden = model(rows, position_ids=pos.expand(rows.shape[0], L), output="hidden")  # [r, L, D]
        picked = hidden[masked]  # [T, D]
        target = ids.to(dev).expand(rows.shape[0], L)[masked]  # [T]
        r_idx = masked.nonzero(as_tuple=True)[0].cpu()
        lps = []
        for b in range(0, picked.shape[0], HEAD_CHUNK):
            logits = model.head(picked[b:b + HEAD_CHUNK]).float()  # [c, V]
            logits[:, mask_id] = float("-inf")
            lps.append(torch.log_softmax(logits, -1).gather(-1, target[b:b + HEAD_CHUNK, None]).squeeze(-1))
        lp = torch.cat(lps).double().cpu() if lps else torch.zeros(0, dtype=torch.float64)
        w = weights[a:a + per_forward][masked.cpu()]
        out[a:a + per_forward] = torch.zeros(rows.shape[0], dtype=torch.float64).index_add_(0, r_idx, w * lp)
    return out


def text_elbo(model: Any, ids: list[int], num_samples: int, gen: torch.Generator,
              max_row_tokens: int = MAX_ROW_TOKENS) -> TokenScores:
    """One text's per-token values (E_p - E_{p+1}) and the standard errors of E_p (module docstring)."""
    L = len(ids)
    if L < 2:  # nothing to condition on, nothing to score
        return TokenScores([None] * L, None, 0, stderr=[None] * L, num_samples=num_samples)
    x = torch.tensor(ids, dtype=torch.long)
    mask_id, block = model.config.mask_token_id, max(1, int(model.config.block_size))
    parts = [split_rows(x, p, num_samples, mask_id, gen) for p in range(1, L)]
    pad = -L % block  # the canvas: whole blocks, the tail masked and never scored
    noisy = torch.nn.functional.pad(torch.cat([n for n, _ in parts]), (0, pad), value=mask_id)  # [(L-1) N, L+pad]
    weights = torch.nn.functional.pad(torch.cat([w for _, w in parts]), (0, pad))
    x = torch.nn.functional.pad(x, (0, pad), value=mask_id)
    samples = _row_values(model, x, noisy, weights, max_row_tokens).view(L - 1, num_samples)  # [L-1, N]
    est = samples.mean(1)  # E_1 .. E_{L-1}
    se = samples.std(1) / math.sqrt(num_samples) if num_samples > 1 else torch.full_like(est, float("nan"))
    nxt = torch.cat([est[1:], est.new_zeros(1)])
    values: list[float | None] = [None, *(float(v) for v in (est - nxt).tolist())]
    errors: list[float | None] = [None, *(None if math.isnan(v) else float(v) for v in se.tolist())]
    return TokenScores(values, None, noisy.shape[0], stderr=errors, num_samples=num_samples)


def elbo_logprobs(model: Any, texts: list[list[int]], num_samples: int, seed: int = 0,
                  max_row_tokens: int = MAX_ROW_TOKENS) -> list[TokenScores]:
    """Per text, every token's ELBO value and standard error (module docstring); seeded, so the same request
    gets the same numbers."""
    if num_samples < 1:
        raise ValueError("num_samples: must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    return [text_elbo(model, ids, num_samples, gen, max_row_tokens) for ids in texts]
