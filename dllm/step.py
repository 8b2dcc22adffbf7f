"""The model's step: one denoising forward + sampling + commit over typed inputs, with static shapes, on the device.

    x = StepInputs(ids, block_start, write, page_table, k, strategy, threshold, temperature, top_k, top_p,
                   greedy, uniforms, bias_ids, bias_values)  # typed tensors (dllm.step_inputs packs them; dllm.runner runs this)
    out = decode_step(model, cache, x, k_pos, filtered, attention="sdpa")   # -> StepResult, on the device

A step's rows are the blocks being denoised (the first `Rn` are sampled), then the clean blocks owed
to the cache (a just-finished block, a one-block prompt), then padding; the runner pads them to a
row bucket and the keys to a page-aligned bucket (`buckets`), so the shapes are static per bucket.
`decode_step` runs with no host synchronisation and no data-dependent shape: the mask, positions and
cache addressing (each row's page table) are built once (not per layer), every layer writes its
K/V once, and only the sampled rows go through the vocabulary projection, the sampler
(`dllm.sampling.sample_typed`) and the commit rules (`dllm.commit.commit_mask`, all strategies) --
tensor ops on every row. Padding rows write into the cache's scratch page and no real row attends
to them; the outputs of clean and padding rows are never read. It is what the runner compiles
(torch.compile) or captures (CUDA graphs) per bucket; it reads only the inputs, the KV pools and
the parameters, so weight updates copied in place keep compiled code and graphs valid.

The float64 row layout below (`FIELDS`, `columns`, `width`, `padding_row`) is the full-attention
runner's (dllm.full.runner) until it takes this typed step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from dllm.attention import MaskSpec
from dllm.commit import commit_mask
from dllm.kv_cache import KVCache
from dllm.logit_bias import MAX_ENTRIES, dense_bias
from dllm.model import SDARForCausalLM
from dllm.sampling import PARAM_FIELDS, sample_typed


class StepInputs(NamedTuple):
    """One denoising forward's inputs on the device: R rows (sequences, clean rows, padding), the first Rn
    of them sampled; P pages of keys per row."""

    ids: torch.Tensor          # [R, B] int64: each row's block (not yet committed positions: the mask id)
    block_start: torch.Tensor  # [R] int64: absolute position of each row's block
    write: torch.Tensor        # [R] bool: the row's K/V go into its pages (padding: into the scratch page)
    page_table: torch.Tensor   # [R, P] int64: each row's KV pages (0: the scratch page)
    k: torch.Tensor            # [Rn] int64: positions the schedule commits now (dynamic: at least these)
    strategy: torch.Tensor     # [Rn] int64: Strategy.code
    threshold: torch.Tensor    # [Rn] float64: dynamic's confidence threshold
    temperature: torch.Tensor  # [Rn] float64: 1 for greedy rows
    top_k: torch.Tensor        # [Rn] int64: 0 = off
    top_p: torch.Tensor        # [Rn] float64
    greedy: torch.Tensor       # [Rn] bool
    uniforms: torch.Tensor     # [Rn, B] float64: the sampling noise (dllm.sampling.counter_uniforms)
    bias_ids: torch.Tensor     # [Rn, K] int64: logit_bias token ids, padded with 0 (K = dllm.logit_bias.MAX_ENTRIES)
    bias_values: torch.Tensor  # [Rn, K] float64: their biases, padded with 0.0 (adds nothing)


class StepResult(NamedTuple):
    """What a step hands back for its Rn sampled rows (the runner reads the first N: the sequences)."""

    ids: torch.Tensor        # [Rn, B] int64: the block after the forward
    logprobs: torch.Tensor   # [Rn, B] fp32: log p of the token sampled at each position (read where committed)
    committed: torch.Tensor  # [Rn, B] bool: positions committed by this forward
    ok: torch.Tensor         # [Rn] bool: the row's probabilities were finite (else nothing is committed)


def buckets(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit` (included)."""
    out = [1]
    while out[-1] < limit:
        out.append(min(2 * out[-1], limit))
    return out


def sample_and_commit(logits: torch.Tensor, x: StepInputs, mask_id: int, filtered: bool) -> StepResult:
    """logits: [Rn, B, V] of the sampled rows -> their new blocks: every row the same ops, on the device."""
    Rn = logits.shape[0]
    block = x.ids[:Rn]
    tok, lp = sample_typed(logits, x.temperature, x.top_k, x.top_p, x.greedy, x.uniforms, mask_id, filtered,
                           (x.bias_ids, x.bias_values))  # every row's logit_bias pairs, static shapes
    masked = block == mask_id
    ok = (torch.isfinite(lp) | ~masked).all(-1)  # [Rn]
    commit = commit_mask(lp.exp(), masked, x.k, x.threshold.float(), x.strategy) & ok[:, None]
    return StepResult(torch.where(commit, tok, block), lp, commit, ok)


def decode_step(model: SDARForCausalLM, cache: KVCache, x: StepInputs, k_pos: torch.Tensor, filtered: bool,
                attention: str = "sdpa") -> StepResult:
    """x: the step's typed inputs (R rows, Rn sampled), k_pos: [KV] key positions (the bucket) -> the
    sampled rows' StepResult. attention: "sdpa" or "flash" (the cache attention's kernel)."""
    B, mask_id = model.config.block_size, model.config.mask_token_id
    R, KV, Rn = x.ids.shape[0], k_pos.shape[0], x.k.shape[0]
    pos = x.block_start[:, None] + torch.arange(B, device=x.ids.device)  # [R, B]
    kp = k_pos.expand(R, KV)
    spec = MaskSpec(pos, kp, B, k_valid=kp <= pos[:, -1:], backend=attention)  # keys past a row's block: stale
    view = cache.view(x.page_table, pos, k_pos, x.write[:, None].expand(R, B))
    logits = model.lm_head(model.hidden_states(x.ids, spec, view)[:Rn])  # [Rn, B, V]: the sampled rows
    return sample_and_commit(logits, x, mask_id, filtered)


# ----------------------------------------------------------------------------- the full-attention decoder's rows

FIELDS = ("block_start", "step", "k", "strategy", "threshold", "slot", "write", *PARAM_FIELDS)
# row layout: block ids, steps, logprobs [3B] | FIELDS | sampling uniforms [B] | logit_bias ids [K], values [K]
# (K = dllm.logit_bias.MAX_ENTRIES, padded with zeros: the same width whatever the row's bias)


def columns(block_size: int) -> dict[str, int]:
    """Column of each FIELDS value in a packed row (the block and the uniforms around them)."""
    return {name: 3 * block_size + i for i, name in enumerate(FIELDS)}


def width(block_size: int) -> int:
    return 4 * block_size + len(FIELDS) + 2 * MAX_ENTRIES


def row_bias(rows: torch.Tensor, block_size: int, vocab_size: int) -> torch.Tensor:
    """Packed rows [R, width(B)] -> their logit_bias as a dense [R, V] fp32 additive tensor (no host sync)."""
    at = 4 * block_size + len(FIELDS)
    return dense_bias(rows[:, at:at + MAX_ENTRIES].long(), rows[:, at + MAX_ENTRIES:at + 2 * MAX_ENTRIES], vocab_size)


def padding_row(block_size: int, mask_id: int) -> np.ndarray:
    """A packed row that is never read (greedy, no commit)."""
    row = np.zeros(width(block_size))
    col = columns(block_size)
    row[:block_size] = mask_id
    row[[col["step"], col["temperature"], col["top_p"], col["greedy"]]] = 1.0
    row[3 * block_size + len(FIELDS):4 * block_size + len(FIELDS)] = 0.5  # the uniforms; no logit_bias
    return row
