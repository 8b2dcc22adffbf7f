"""Sampling, ranking and commit of full-attention decoding (LLaDA, Dream) as their official rollouts do them.

    logp = full_sampling_logprobs(logits, params, mask_id)            # [..., V]: the distribution (the definition)
    out = sample_and_commit_full(logits, rows, mask_id, filtered, family="llada")   # the batched step: [R, 3B + 1]
    ids = official_draws(...)                                          # rng="official": the official torch draws

The distribution (`sample/dream_rl_rollout.py: sample_tokens`): the mask token removed, logits divided by the
temperature, then top-p, then top-k (Dream's order; LLaDA's rollout has neither, dlrl applies them the same
way), as dllm.sampling otherwise (greedy below GREEDY_BELOW: the argmax, its log-probability under the
temperature-1 distribution). The trace records log p(token) under exactly this distribution.

Ranking (which masked positions a static forward commits: the most confident ones, `ranking`):
- "official" (the default): LLaDA ranks by the probability of the sampled token under the untempered,
  unfiltered softmax (`get_transfer_index`: `softmax(logits)` while sampling Gumbel-max from the tempered
  one); Dream by its probability under the distribution it was sampled from (`probs.gather(x0)`);
- "tempered": both by the probability under the sampling distribution (dllm.sampling's rule for SDAR).
Dream's `pad_target_penalty` divides the confidence of a position whose token is the pad id (1.0: off).

Commit (`commit_full`): static: the k most confident (k from the family's schedule, dllm.full.schedule);
dynamic: every masked position whose confidence is >= the threshold, else the single most confident one
(both rollouts' `unmask_threshold` rule: at least one per forward whatever `steps` says); sequential: the k
leftmost (dlrl's). Ties rank the lower position first.

`official_draws` (rng="official", eager only): the official functions' own random draws from a
torch.Generator per sequence seeded with the request seed, consumed as the official function consumes the
global generator for that sequence alone -- LLaDA: `add_gumbel_noise`'s `rand_like` (float64) over every
position of each forward's logits, then the Gumbel-max argmax of the block's positions; Dream: `Categorical`'s
`torch.multinomial` over every canvas position at a block's first forward (the first position's row used),
then over the block's masked positions. Same seed, same device, same tokens as the official code.
"""

from __future__ import annotations

import torch

from dllm.logit_bias import apply_bias
from dllm.sampling import (
    PARAM_FIELDS,
    SamplingParams,
    _inverse_cdf,  # noqa: PLC2701 - one home of the inverse-CDF draw
    _top_p_filter,  # noqa: PLC2701 - one home of the top-p rule
    vocab_max,
)
from dllm.step import FIELDS, columns, row_bias
from dllm.strategy import Strategy

RANKINGS = ("official", "tempered")
RNGS = ("counter", "official")


def full_sampling_logprobs(logits: torch.Tensor, params: SamplingParams, mask_id: int) -> torch.Tensor:
    """logits [..., V] -> log-probabilities [..., V] of the sampling distribution (fp32): the definition."""
    x = logits.float().clone()
    x[..., mask_id] = float("-inf")
    if not params.is_greedy and params.temperature != 1.0:
        x = x / params.temperature
    if params.top_p < 1.0:
        x = _top_p_filter(x, params.top_p)
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def filtered_logits(logits: torch.Tensor, params: torch.Tensor, mask_id: int, filtered: bool) -> torch.Tensor:
    """logits [N, B, V], params [N, 4] (PARAM_FIELDS) -> the tempered, top-p then top-k filtered logits (fp32),
    every row the same ops (no host sync: the static step's)."""
    V = logits.shape[-1]
    x = logits.float().clone()
    x[..., mask_id] = float("-inf")
    x = x / params[:, 0, None, None].float()
    if filtered:
        top_p = params[:, 2, None, None]
        x = torch.where(top_p < 1.0, _top_p_filter(x, top_p.float()), x)
        top_k = params[:, 1].long()
        k = torch.where((top_k > 0) & (top_k < V), top_k, V)  # [N]
        kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
        x = x.masked_fill(x < kth, float("-inf"))
    return x


def commit_full(conf: torch.Tensor, masked: torch.Tensor, k: torch.Tensor, threshold: torch.Tensor,
                strategy: torch.Tensor) -> torch.Tensor:
    """conf [N, B], masked [N, B] bool, k / threshold / strategy (Strategy.code) [N] -> positions to commit."""
    N, B = conf.shape
    k = torch.minimum(k, masked.sum(-1))[:, None]  # [N, 1]
    ranked = conf.masked_fill(~masked, -1.0)  # unmasked positions rank last
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(B, device=conf.device).expand(N, B))
    top = masked & (rank < k)
    above = masked & (conf >= threshold[:, None])
    dynamic = torch.where(above.any(-1, keepdim=True), above, masked & (rank < 1))
    sequential = masked & (masked.cumsum(-1) <= k)
    code = strategy[:, None]
    return torch.where(code == Strategy.dynamic.code, dynamic,
                       torch.where(code == Strategy.sequential.code, sequential, top))


def confidence(logits: torch.Tensor, x: torch.Tensor, lp: torch.Tensor, ids: torch.Tensor, mask_id: int,
               family: str, ranking: str) -> torch.Tensor:
    """The confidence a static / dynamic forward ranks by (see the module docstring), [R, B] fp32 / fp64.
    logits: raw [R, B, V]; x: the filtered logits; lp: log p(ids) under the sampling distribution."""
    if family == "llada" and ranking == "official":  # softmax(logits.to(float64)) of the untempered logits
        raw = logits.float().clone()
        raw[..., mask_id] = float("-inf")
        picked = raw.gather(-1, ids[..., None]).squeeze(-1)
        return (picked.double() - torch.logsumexp(raw, -1).double()).exp()
    if family == "dream":  # Categorical(logits=x).probs.gather(x0): float32, normalised first
        probs = torch.softmax(x - x.logsumexp(-1, keepdim=True), -1)
        return probs.gather(-1, ids[..., None]).squeeze(-1)
    return lp.exp()


def sample_and_commit_full(logits: torch.Tensor, rows: torch.Tensor, mask_id: int, filtered: bool, *,
                           family: str, ranking: str = "official", pad_id: int = -1, pad_penalty: float = 1.0,
                           drawn: torch.Tensor | None = None,
                           topk_layout: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """logits [R, B, V] of the block's positions, rows [R, width(B)] (dllm.step's layout) -> [R, 3B + 1]: the new
    block ids, steps, log-probabilities and a finite flag. `drawn` [R, B]: the sampled rows' tokens drawn
    elsewhere (rng="official") instead of the counter-noise inverse-CDF draw (greedy rows take the argmax);
    The rows' logit_bias (dllm.step.row_bias) is added to `logits` first: confidence, draws and log-probabilities
    all see the biased logits. `topk_layout`: per row (width, offset) of the official confidence vector, whose torch.topk order then breaks
    ties among equally confident positions as the official code does (`official_topk`)."""
    R, B = logits.shape[:2]
    col, f = columns(B), 3 * B + len(FIELDS)
    logits = apply_bias(logits, row_bias(rows, B, logits.shape[-1]))  # the rows' logit_bias, before anything else
    params = rows[:, col[PARAM_FIELDS[0]]:col[PARAM_FIELDS[-1]] + 1]  # [R, 4]
    x = filtered_logits(logits, params, mask_id, filtered)  # [R, B, V]
    logp = torch.log_softmax(x, dim=-1)
    sampled = drawn if drawn is not None else _inverse_cdf(logp, rows[:, f:f + B])
    ids = torch.where(params[:, 3, None] > 0, vocab_max(logp)[1], sampled)
    lp = logp.gather(-1, ids[..., None]).squeeze(-1)  # [R, B]
    conf = confidence(logits, x, lp, ids, mask_id, family, ranking)
    if pad_penalty != 1.0:
        conf = torch.where(ids == pad_id, conf / pad_penalty, conf)
    masked = rows[:, :B] == mask_id
    is_ok = (torch.isfinite(lp) | ~masked).all(-1)  # [R]
    k, strategy = rows[:, col["k"]].long(), rows[:, col["strategy"]].long()
    commit = commit_full(conf, masked, k, rows[:, col["threshold"]].double(), strategy)
    if topk_layout is not None:
        commit = official_topk(commit, conf, masked, k, strategy, topk_layout)
    commit &= is_ok[:, None]
    step = rows[:, col["step"], None].expand(R, B)
    new = torch.stack([ids.double(), step, lp.double()], 1)  # [R, 3, B]
    block = torch.where(commit[:, None], new, rows[:, :3 * B].reshape(R, 3, B))
    return torch.cat([block.reshape(R, 3 * B), is_ok[:, None].double()], 1)


def official_topk(commit: torch.Tensor, conf: torch.Tensor, masked: torch.Tensor, k: torch.Tensor,
                  strategy: torch.Tensor, layout: list[tuple[int, int]]) -> torch.Tensor:
    """Static rows committed as the official code picks them: `torch.topk` of a confidence vector of the official
    width (the block's masked positions at `offset`, -inf elsewhere), whose order among equal values depends on
    that width (and the device); every other row keeps `commit`."""
    out = commit.clone()
    B = conf.shape[1]
    for r, (width, offset) in enumerate(layout):
        n = min(int(k[r]), int(masked[r].sum()))
        if int(strategy[r]) != Strategy.static.code or n <= 0:
            continue
        v = torch.full((width,), float("-inf"), dtype=conf.dtype, device=conf.device)
        v[offset:offset + B] = conf[r].masked_fill(~masked[r], float("-inf"))
        out[r] = False
        out[r, torch.topk(v, n).indices - offset] = True
    return out


def official_draws(family: str, logits: torch.Tensor, params: SamplingParams, mask_id: int, gen: torch.Generator,
                   *, width: int, offset: int, masked: list[int], first: bool) -> torch.Tensor:
    """The official functions' draws for ONE sequence's forward (see the module docstring): logits [B, V] of the
    block -> token ids [B] (only `masked` positions -- for Dream's first forward position 0 -- are drawn).
    LLaDA: `width` positions of Gumbel noise drawn, the block's at `offset`; Dream: `width` canvas rows drawn at
    a block's first forward (the block's first position is row `offset`), else one row per masked position."""
    B, V = logits.shape
    dev = logits.device
    keep = full_sampling_logprobs(logits, params, mask_id)  # [B, V]: -inf where removed (mask, top-k / top-p)
    if family == "llada":
        u = torch.rand(width, V, dtype=torch.float64, device=dev, generator=gen)[offset:offset + B]
        raw = logits.double().masked_fill(torch.isinf(keep), float("-inf"))
        noise = (-torch.log(u)) ** params.temperature
        return torch.argmax(raw.exp() / noise, dim=-1)
    x = logits.float() / params.temperature
    x = x.masked_fill(torch.isinf(keep), torch.finfo(x.dtype).min)  # top_p_logits / top_k_logits fill
    norm = x - x.logsumexp(-1, keepdim=True)  # torch.distributions.Categorical(logits=...)
    probs = torch.softmax(norm, -1)
    ids = keep.argmax(-1)  # positions the official function draws nothing for: any token of the support
    if first:  # sample_tokens over the whole canvas: only the block's first position's row is used
        rows = probs[:1].expand(width, V).clone()
        ids[0] = torch.multinomial(rows, 1, True, generator=gen)[offset, 0]
    elif masked:
        idx = torch.tensor(masked, device=dev)
        ids[idx] = torch.multinomial(probs[idx], 1, True, generator=gen)[:, 0]
    return ids
