"""Prompt log-likelihoods of a block-diffusion (SDAR) model: exact sequential, or the Monte Carlo ELBO.

Blocks are aligned to absolute position 0 (docs/DESIGN.md, Trace). Every token p >= 1 of a text
x gets a log-probability; token 0 has none (OpenAI's first `token_logprobs` entry is null).

- `sequential` (exact): log p(x_p | x_<p) under the sequential decoding policy, i.e. the state
  in which that policy commits x_p: earlier blocks clean, the block's tokens before p visible,
  p and the rest of its block masked (a last block runs to its end with masks, as when decoding).
  Summed over a continuation it is the exact log-likelihood of the continuation given what
  precedes it under that policy. The state of offset o within a block is the same rule for
  every block, so all blocks of a text share ONE row of the noisy-copy + clean-copy replay
  layout (dllm.replay): a text costs min(block_size, len) rows, one forward each, batched.
- `elbo` (estimate): the masked-diffusion evidence lower bound, estimated as LLaDA evaluates
  it: per sample and per block of m scored tokens, draw l uniform in 1..m, mask l of them
  uniformly at random (earlier blocks clean, the block's other tokens visible), and add
  (m / l) * log p(x_i | state) for each masked token; average over `num_samples` seeded
  samples (one row per sample). Its expectation is the mean over all decoding orders of a
  block of the any-order log-likelihood, a lower bound of the log of the model's
  order-averaged likelihood; each token's value is its share (the sum over tokens is the
  estimate). Token 0 is never masked (it is the context of the first block). Each token also gets the
  standard error of the estimate of the sum from it to the end (`TokenScores.stderr`).
- full-attention models (LLaDA, Dream): LLaDA's own estimator for every context / continuation split,
  dllm/full/likelihood.py (`prompt_logprobs` dispatches there).

    scores = sequential_logprobs(model, [[5, 6, 7, 8]], top_k=2)   # [TokenScores]
    scores[0].logprobs                                              # [None, lp1, lp2, lp3]
    scores = elbo_logprobs(model, texts, num_samples=16, seed=0)
    python -m pytest -q tests/dllm/test_likelihood.py
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dllm.replay import RowParts, Rows, replay_hidden, stack_rows
from dllm.scores import METHODS, Method, TokenScores

__all__ = ["HEAD_CHUNK", "MAX_ROW_TOKENS", "METHODS", "Method", "TokenScores", "elbo_logprobs", "prompt_logprobs",
           "sequential_logprobs"]

MAX_ROW_TOKENS = 8192  # tokens of rows run in one forward (each row is 2L in the replay layout)
HEAD_CHUNK = 64  # scored tokens whose full-vocabulary logits exist at once


def _padded(ids: list[int], block_size: int, mask_id: int) -> tuple[torch.Tensor, int]:
    """The text padded with masks to its last block's end: ([L] long, L)."""
    L = math.ceil(len(ids) / block_size) * block_size
    x = torch.full((L,), mask_id, dtype=torch.long)
    x[:len(ids)] = torch.tensor(ids, dtype=torch.long)
    return x, L


def _stack(per_row: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], pad_id: int) -> Rows:
    """[(noisy [L], clean [L], target [L] bool, text index)] -> Rows padded to the longest L (padding invalid)."""
    # token_idx: the scored token's position in its text
    return stack_rows([RowParts(nz, cl, nz.shape[0], tg, torch.where(tg, torch.arange(nz.shape[0]), -1), i)
                       for nz, cl, tg, i in per_row], pad_id)


def sequential_rows(texts: list[list[int]], block_size: int, mask_id: int,
                    pad_id: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Per text, one row per offset o within a block: tokens at offsets < o visible, the rest masked;
    the targets are the tokens at offset o (position >= 1)."""
    out = []
    for i, ids in enumerate(texts):
        x, L = _padded(ids, block_size, mask_id)
        pos = torch.arange(L)
        offset = pos % block_size
        for o in range(min(block_size, len(ids))):
            target = (offset == o) & (pos >= 1) & (pos < len(ids))
            if target.any():
                out.append((torch.where(offset < o, x, mask_id), x, target, i))
    return out


def elbo_rows(texts: list[list[int]], block_size: int, mask_id: int, num_samples: int, seed: int,
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], list[torch.Tensor]]:
    """Per text, `num_samples` rows of LLaDA's masking (per block: l ~ U{1..m}, l of its m scored
    tokens masked) and each row's weights [L] (m / l at masked tokens, divided by num_samples)."""
    gen = torch.Generator().manual_seed(seed)
    rows, weights = [], []
    for i, ids in enumerate(texts):
        x, L = _padded(ids, block_size, mask_id)
        for _ in range(num_samples):
            masked = torch.zeros(L, dtype=torch.bool)
            weight = torch.zeros(L)
            for start in range(0, len(ids), block_size):
                scored = torch.arange(max(start, 1), min(start + block_size, len(ids)))
                m = scored.numel()
                if m == 0:
                    continue
                num = int(torch.randint(1, m + 1, (1,), generator=gen))
                pick = scored[torch.randperm(m, generator=gen)[:num]]
                masked[pick] = True
                weight[pick] = m / num / num_samples
            target = masked & (torch.arange(L) < len(ids))
            if not target.any():  # a one-token text: nothing to score
                break
            masked[len(ids):] = True  # the last block's tail: masks, as when decoding
            rows.append((torch.where(masked, mask_id, x), x, target, i))
            weights.append(weight)
    return rows, weights


def _chunks(rows: list[Any], max_row_tokens: int) -> list[slice]:
    """Row ranges whose padded size (rows x longest row) stays within max_row_tokens (one row at least)."""
    out, start, longest = [], 0, 0
    for r, row in enumerate(rows):
        longest_now = max(longest, row[0].shape[0])
        if r > start and (r - start + 1) * longest_now > max_row_tokens:
            out.append(slice(start, r))
            start, longest_now = r, row[0].shape[0]
        longest = longest_now
    if start < len(rows):
        out.append(slice(start, len(rows)))
    return out


@torch.no_grad()
def _score(model: Any, rows: Rows, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target token ([T], row-major order of `rows.target`) and its top-k (id, logprob)
    ([T, k, 2]) under the model's distribution (temperature 1, mask token excluded), fp32."""
    hidden = replay_hidden(model, rows)  # [R, L, D]
    picked = hidden[rows.target.to(hidden.device)]  # [T, D]
    ids = rows.clean[rows.target].to(hidden.device)  # [T]
    mask_id = model.config.mask_token_id
    lps, tops = [], []
    for a in range(0, picked.shape[0], HEAD_CHUNK):
        logits = model.lm_head(picked[a:a + HEAD_CHUNK]).float()  # [c, V]
        logits[:, mask_id] = float("-inf")
        logp = torch.log_softmax(logits, dim=-1)
        lps.append(logp.gather(-1, ids[a:a + HEAD_CHUNK, None]).squeeze(-1))
        if top_k:
            v, t = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
            tops.append(torch.stack([t.double(), v.double()], dim=-1))
    lp = torch.cat(lps).cpu() if lps else torch.zeros(0)
    return lp, (torch.cat(tops).cpu() if tops else None) if top_k else None


def _run(model: Any, texts: list[list[int]], per_row: list[Any], weights: list[torch.Tensor] | None,
         top_k: int, max_row_tokens: int) -> list[TokenScores]:
    """Run the rows in chunks; accumulate (weighted) logprobs per text and position."""
    sums = [torch.zeros(len(t), dtype=torch.float64) for t in texts]
    tops: list[list[list[tuple[int, float]]]] = [[[] for _ in t] for t in texts]
    counts = [0] * len(texts)
    per_sample: list[list[torch.Tensor]] = [[] for _ in texts]  # elbo: each sample row's weighted values [L]
    pad_id = 0
    for part in _chunks(per_row, max_row_tokens):
        rows = _stack(per_row[part], pad_id)
        lp, top = _score(model, rows, top_k)
        r_idx, c_idx = rows.target.nonzero(as_tuple=True)  # row-major: the order of `lp`
        vals = lp.double() * (torch.stack(weights[part])[r_idx, c_idx].double() if weights is not None else 1.0)
        text_of = rows.row_sample[r_idx]
        for i in text_of.unique().tolist():
            here = text_of == i
            sums[i].index_add_(0, c_idx[here], vals[here])
        if weights is not None:
            dense = torch.zeros(rows.noisy.shape, dtype=torch.float64)
            dense[r_idx, c_idx] = vals
            for r in range(rows.noisy.shape[0]):
                i = int(rows.row_sample[r])
                per_sample[i].append(dense[r, :len(texts[i])])
        if top is not None:
            for j, (r, c) in enumerate(zip(r_idx.tolist(), c_idx.tolist())):
                tops[int(rows.row_sample[r])][c] = [(int(a), float(b)) for a, b in top[j].tolist() if b > float("-inf")]
        for r in range(rows.noisy.shape[0]):
            counts[int(rows.row_sample[r])] += 1
    return [TokenScores([None] + [float(v) for v in s[1:]], t if top_k else None, n,
                        *(_suffix_stderr(rows_i, len(s)) if weights is not None else (None, None)))
            for s, t, n, rows_i in zip(sums, tops, counts, per_sample)]


def _suffix_stderr(rows: list[torch.Tensor], length: int) -> tuple[list[float | None], int]:
    """(per token the standard error of the estimate of the sum from that token on, number of samples), from
    the sample rows' weighted values (each 1/N of a sample's estimate)."""
    n = len(rows)
    if n < 2:
        return [None] * length, n
    suffix = torch.stack(rows).flip(1).cumsum(1).flip(1) * n  # [N, L]: each sample's estimate of every suffix
    se = (suffix.std(0) / n ** 0.5).tolist()
    return [None] + [float(v) for v in se[1:]], n


def sequential_logprobs(model: Any, texts: list[list[int]], top_k: int = 0,
                        max_row_tokens: int = MAX_ROW_TOKENS) -> list[TokenScores]:
    """Exact sequential-policy logprob of every token of each text (see the module docstring)."""
    cfg = model.config
    return _run(model, texts, sequential_rows(texts, cfg.block_size, cfg.mask_token_id), None, top_k,
                max_row_tokens)


def elbo_logprobs(model: Any, texts: list[list[int]], num_samples: int, seed: int = 0,
                  max_row_tokens: int = MAX_ROW_TOKENS) -> list[TokenScores]:
    """Monte Carlo ELBO shares of every token of each text (their sum: the ELBO estimate)."""
    if num_samples < 1:
        raise ValueError("num_samples: must be >= 1")
    cfg = model.config
    rows, weights = elbo_rows(texts, cfg.block_size, cfg.mask_token_id, num_samples, seed)
    return _run(model, texts, rows, weights, 0, max_row_tokens)


def prompt_logprobs(model: Any, texts: list[list[int]], method: Method, *, top_k: int = 0,
                    num_samples: int = 16, seed: int = 0) -> list[TokenScores]:
    """The server's entry: `method` sequential (top-k alternatives when asked) or elbo (no alternatives). A
    full-attention model (LLaDA, Dream) is scored by LLaDA's conditional ELBO for every split
    (dllm.full.likelihood); `sequential` is a block-causal policy's and does not apply to it."""
    if getattr(model, "attention", "") == "full":
        if method != "elbo":
            raise ValueError("likelihood: full-attention models are scored by the Monte Carlo ELBO ('elbo')")
        from dllm.full.likelihood import elbo_logprobs as full_elbo

        return full_elbo(model, texts, num_samples, seed)
    if method == "sequential":
        return sequential_logprobs(model, texts, top_k)
    return elbo_logprobs(model, texts, num_samples, seed)
