"""Sampling parameters and the sampling distribution of block decoding: its definition and the batched sampler.

    params.validate(block_size)                            # FieldError(field, message)
    logp = sampling_logprobs(logits, params, mask_id)      # [..., V]: the distribution (the definition)
    ids, lp = sample_tokens(logp, params, u)               # one sequence's positions, row by row
    ids, lp = sample_batch(logits, params_list, u, mask_id)  # [N, B, V]: every running sequence at once
    ids, lp = sample_typed(logits, temperature, top_k, top_p, greedy, u, mask_id, filtered)  # the same, no
                                                           # host sync: the decode step's (dllm.step)
    ids, lp = sample_static(logits, param_rows, u, mask_id, filtered)  # the same, parameters as [N, 4]
    u = counter_uniforms(seeds, positions, steps)          # [N, B] noise (numpy): a pure function of its inputs

The distribution: logits plus the request's `logit_bias` (dllm.logit_bias), the mask token removed, divided by the temperature, then
top-k and top-p filtered; the Trace records log p(token) under exactly this distribution.
Greedy decoding (`temperature` 0, or any temperature below `GREEDY_BELOW` = 1e-5: dividing
logits by e.g. 1e-38 overflows to inf and every probability becomes NaN) takes the argmax and
records its log-probability under the temperature-1 distribution (still top-k / top-p
filtered).

Sampling is inverse-CDF: one uniform u in (0, 1] per position picks the first token whose
cumulative probability reaches u x total. The uniforms come from a counter-based hash
(splitmix64) of (request seed, absolute position, denoising step), computed on the host and
shipped with the step's other inputs, so a seeded request gives the same tokens whatever
else shares its batch, on any device, with no generator state to carry (unseeded sequences
draw their seed from torch's global generator). `sample_typed` applies
every row's own temperature / top-k / top-p with the same tensor ops for every row (the
parameters are a tensor, no Python branch per row, no data-dependent shape: the static decode
step runs it) and gathers the sampled tokens' log-probabilities in one op; it is
token-for-token the row-by-row definition (`sampling_logprobs` + `sample_tokens`).

The greedy argmax of `sample_typed` runs in two stages over chunks of `VOCAB_CHUNK` tokens (`vocab_max`: per-chunk max and first
index, then the first chunk holding the overall max): the same values and indices as
`torch.max` / `torch.argmax` (ties and NaN: the lowest index), but each argmax is at most
`VOCAB_CHUNK` wide with a static size, which inductor's Triton codegen compiles (one argmax
over SDAR's 151,936 tokens with a dynamic row count did not, torch 2.11 on CUDA). The
log-softmax stays torch's (bit-equal to the definition); the static decode step compiles it
per bucket with static shapes (dllm.step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dllm.logit_bias import add_pairs_, bias_rows, pairs_of
from dllm.sampling_params import GREEDY_BELOW, PARAM_FIELDS, SamplingParams, needs_filter, param_row

__all__ = ["GREEDY_BELOW", "PARAM_FIELDS", "VOCAB_CHUNK", "BiasPairs", "SamplingParams", "counter_uniforms",
           "needs_filter", "param_row", "sample_batch", "sample_static", "sample_tokens", "sample_typed",
           "sampling_logprobs", "vocab_max"]
BiasPairs = tuple[torch.Tensor, torch.Tensor]  # logit_bias (ids [N, K], values [N, K]) per row (dllm.logit_bias)
VOCAB_CHUNK = 2048  # width of the first stage of the sampler's vocabulary-wide max / argmax


# ----------------------------------------------------------------------------- the definition (one params)

def sampling_logprobs(logits: torch.Tensor, params: SamplingParams, mask_token_id: int) -> torch.Tensor:
    """logits: [..., V] -> log-probabilities [..., V] of the sampling distribution (fp32)."""
    logits = logits.float().clone()
    bias = bias_rows([params.logit_bias], logits.shape[-1], logits.device)
    if bias is not None:
        logits = logits + bias[0]
    logits[..., mask_token_id] = float("-inf")
    if not params.is_greedy and params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p_filter(logits, params.top_p)
    return torch.log_softmax(logits, dim=-1)


def sample_tokens(logprobs: torch.Tensor, params: SamplingParams,
                  uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs: [L, V], uniforms: [L] in (0, 1] -> (token ids [L], their logprobs [L])."""
    if params.is_greedy:
        ids = logprobs.argmax(-1)
    else:
        assert uniforms is not None, "sample_tokens: sampling (temperature > 0) needs uniforms"
        ids = _inverse_cdf(logprobs, uniforms)
    return ids, logprobs.gather(-1, ids[..., None]).squeeze(-1)


def _top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (broadcast over rows)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    drop = cum > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def _inverse_cdf(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """logprobs [..., V], uniforms [...] in (0, 1] -> the first token whose cumulative mass reaches u."""
    cdf = logprobs.exp().cumsum(-1)  # [..., V]; zero-probability tokens add nothing, so are never picked
    target = uniforms[..., None].to(cdf.dtype) * cdf[..., -1:]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


# ----------------------------------------------------------------------------- batched (the engine)

def sample_batch(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, B, V] (row r sampled with params[r]; fp32 logits are overwritten), uniforms: [N, B] ->
    (token ids [N, B], their logprobs [N, B] fp32; NaN/inf where a row's probabilities are not finite)."""
    dev = logits.device
    cols = torch.tensor([param_row(p) for p in params], dtype=torch.float64).to(dev)  # [N, 4]
    bias = pairs_of([p.logit_bias for p in params], dev)
    return sample_static(logits, cols, uniforms, mask_token_id, any(needs_filter(p) for p in params), bias)


def sample_static(logits: torch.Tensor, params: torch.Tensor, uniforms: torch.Tensor, mask_token_id: int,
                  filtered: bool, bias: BiasPairs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_typed` with the parameters as one [N, 4] tensor (PARAM_FIELDS' columns, from `param_row`):
    `sample_batch` and the full-attention runner's packed rows (dllm.full.runner)."""
    return sample_typed(logits, params[:, 0], params[:, 1].long(), params[:, 2], params[:, 3] > 0, uniforms,
                        mask_token_id, filtered, bias)


def sample_typed(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 greedy: torch.Tensor, uniforms: torch.Tensor, mask_token_id: int,
                 filtered: bool, bias: BiasPairs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batched sampler with no host sync and no data-dependent shape (the static decode step's).

    logits: [N, B, V]; per row temperature [N] (float64; 1 for greedy rows), top_k [N] int64 (0 = off),
    top_p [N] float64, greedy [N] bool; uniforms: [N, B] -> (ids [N, B], logprobs [N, B] fp32). Every
    row runs the same ops: temperature 1 divides exactly, top-k with k=0 keeps everything (its k-th
    largest is the mask token's -inf), top-p applies where < 1 only (so rows without it are untouched
    by rounding in the cumulative sum). `filtered` (a Python bool: part of the compiled step's key) is
    False when no row uses top-k / top-p: no sort. `bias`: each row's logit_bias as (ids [N, K], values [N, K])
    padded with (0, 0.0), scatter-added to the raw logits first (dllm.logit_bias.add_pairs_)."""
    V = logits.shape[-1]
    x = logits.float()  # [N, B, V]: a copy unless already fp32 (then the caller's logits are consumed)
    if bias is not None:
        x = add_pairs_(x, *bias)
    x[..., mask_token_id] = float("-inf")
    x = x / temperature[:, None, None].float()
    if filtered:
        k = torch.where((top_k > 0) & (top_k < V), top_k, V)  # [N]
        kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
        x = x.masked_fill(x < kth, float("-inf"))
        p = top_p[:, None, None]
        x = torch.where(p < 1.0, _top_p_filter(x, p.float()), x)
    logp = torch.log_softmax(x, dim=-1)  # [N, B, V]: bit-equal to the definition's (sampling_logprobs)
    ids = torch.where(greedy[:, None], vocab_max(logp)[1], _inverse_cdf(logp, uniforms))
    return ids, logp.gather(-1, ids[..., None]).squeeze(-1)


def vocab_max(x: torch.Tensor, chunk: int = VOCAB_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., V] -> (max [...], index of its first occurrence [...]): `torch.max(x, -1)` in two stages.

    Stage 1: the max and first index within each chunk of `chunk` tokens (the last chunk padded
    with -inf, which never beats a real entry: on ties the lower index wins); stage 2: the first
    chunk whose max is the overall max. NaN propagates as in torch (the first NaN wins)."""
    V = x.shape[-1]
    if chunk >= V:
        return _first_max(x)
    n = -(-V // chunk)
    parts = F.pad(x, (0, n * chunk - V), value=float("-inf")).view(*x.shape[:-1], n, chunk)
    cmax, cidx = _first_max(parts)  # [..., n] each
    best, which = _first_max(cmax)  # [...]
    return best, which * chunk + cidx.gather(-1, which[..., None]).squeeze(-1)


def _first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., n] -> (max, first index of it): NaN counts as the max (torch.max's rule)."""
    return x.amax(-1), x.argmax(-1)


# ----------------------------------------------------------------------------- counter-based noise

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-avalanching 64-bit hash (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def counter_uniforms(seeds: Sequence[int] | torch.Tensor | np.ndarray, positions: torch.Tensor | np.ndarray,
                     steps: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    """seeds: [N] non-negative ints, positions: [N, B], steps: [N] -> uniforms [N, B] float64 in (0, 1].

    A pure function of (seed, position, step), computed on the host in a few vectorised
    uint64 ops: each (position, step) of a sequence gets its own draw, whatever the batch,
    its order or the device the model runs on."""
    seeds = np.asarray([int(s) & 0xFFFFFFFFFFFFFFFF for s in seeds], dtype=np.uint64)[:, None]
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    step = np.asarray(steps, dtype=np.int64).astype(np.uint64)[:, None]
    h = _mix64(_mix64(_mix64(step * _GOLDEN ^ seeds) ^ pos) + _GOLDEN)  # [N, B]
    return ((h >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0 ** -53
