"""Trace replay: rebuild every denoising state of a decoding trace and score its tokens again.

For block models the state of step k of a block is: clean prefix (earlier blocks),
the block's tokens committed at steps < k visible, the rest masked. Blocks only see
clean earlier blocks, so the k-th states of all blocks of a sequence pack into ONE row
of the noisy-copy + clean-copy layout: a sequence costs at most max-steps-per-block rows.
Shrinkage `s` merges s neighbouring steps (row r holds steps r*s+1..(r+1)*s, scored
under the state before step r*s+1); s=1 is exact.

Replay invariant (docs/DESIGN.md): under the same weights, `token_logprobs` of row targets
equals the trace's behaviour logprobs (fp32, temperature 1, no top-k/top-p). The one
replay of the project: the trainer scores rollouts with it (trainer.rl.learner, trainer.rl.replay's
chunked log-probs) and the server finds top-k logprobs with it (server.engine.backends.native).

A sample is anything with `prompt_ids`, `completion_ids` and a `trace` (`steps`, `tail_ids`,
`tail_steps`): a `rollout_client.Rollout` straight off the wire, a
`dllm.decoding.GenerationOutput` or a finished `dllm.sequence.Sequence`.

    rows = build_rows(rollouts, block_size, mask_id, pad_id, shrink=1)
    rows = pad_rows(rows, bucket_length(rows.clean.shape[1], block_size), pad_id)   # optional: length buckets
    hidden = replay_hidden(model, rows)                     # [R, L, D] noisy copy (the replay forward)
    lp = token_logprobs(model.lm_head(hidden), rows.clean, mask_id,   # [R, L]; the traces' logit_bias:
                        bias=dense_row_bias(rows.bias, V))
    old = rows.gather(behaviour_logprobs_per_sample)        # [R, L], zeros off-target
    logits = model.lm_head(trace_hidden(model, seq))        # [C, V]: each completion token's logits
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from dllm.logit_bias import apply_bias, dense_bias
from dllm.ranges import TEMPERATURE


class SampleTrace(Protocol):
    """The part of a decoding trace replay reads (dllm.trace.Trace, the wire's trace model)."""

    @property
    def steps(self) -> Sequence[int]: ...  # per completion token: its 1-based step within its block
    @property
    def tail_ids(self) -> Sequence[int]: ...  # last block's tokens after the truncation point
    @property
    def tail_steps(self) -> Sequence[int]: ...
    @property
    def block_size(self) -> int: ...


class Sample(Protocol):
    """What replay needs of a generated sample (rollout_client.Rollout, dllm.sequence.GenerationOutput)."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...
    @property
    def completion_ids(self) -> Sequence[int]: ...
    @property
    def trace(self) -> SampleTrace | None: ...  # None: generated without return_trace, cannot be replayed


def trace_of(s: Sample) -> SampleTrace:
    if s.trace is None:
        raise ValueError("trace: a sample without its decoding trace cannot be replayed (generate it with "
                         "return_trace=true)")
    return s.trace


@dataclass
class Rows:
    noisy: torch.Tensor  # [R, L] long
    clean: torch.Tensor  # [R, L] long
    pos: torch.Tensor  # [R, L] long
    valid: torch.Tensor  # [R, L] bool
    target: torch.Tensor  # [R, L] bool: tokens scored in this row
    sample_idx: torch.Tensor  # [R, L] long: which sample a target belongs to (-1 elsewhere)
    token_idx: torch.Tensor  # [R, L] long: completion index j of a target (-1 elsewhere)
    row_sample: torch.Tensor  # [R] long
    # [R, K, 2] float64: each row's sample's logit_bias as (id, bias) pairs padded with (0, 0); None: no sample has one
    bias: torch.Tensor | None = None

    def token_bias(self, target: torch.Tensor) -> torch.Tensor | None:
        """The logit_bias pairs [N, K, 2] of the N tokens of `target` [R, L] (row-major, as hidden[target])."""
        if self.bias is None:
            return None
        return self.bias.to(target.device)[target.nonzero(as_tuple=True)[0]]

    def gather(self, per_sample: list[list[float]] | list[torch.Tensor]) -> torch.Tensor:
        """Per-sample per-token values (e.g. behaviour logprobs, advantages) -> [R, L] at targets."""
        out = torch.zeros(self.target.shape, dtype=torch.float32)
        r, c = self.target.nonzero(as_tuple=True)
        vals = [torch.as_tensor(per_sample[int(s)], dtype=torch.float32)[int(j)]
                for s, j in zip(self.sample_idx[r, c], self.token_idx[r, c])]
        if vals:
            out[r, c] = torch.stack(vals)
        return out


def _sample_rows(s: Sample, block_size: int, mask_id: int,
                 shrink: int) -> tuple[list[int], int, list[tuple[list[int], list[bool], list[int]]]]:
    """-> list of (noisy ids, target flags, token idx) for one sample, plus its clean ids."""
    P, tr = len(s.prompt_ids), trace_of(s)
    gen_ids = list(s.completion_ids) + list(tr.tail_ids)
    gen_steps = list(tr.steps) + list(tr.tail_steps)
    clean = list(s.prompt_ids) + gen_ids
    L = math.ceil(len(clean) / block_size) * block_size
    clean = clean + [mask_id] * (L - len(clean))  # never happens for complete blocks
    max_step = max(tr.steps, default=0)
    rows = []
    for r in range(math.ceil(max_step / shrink)):
        lo, hi = r * shrink + 1, (r + 1) * shrink  # steps scored in this row
        noisy = list(clean)
        target = [False] * L
        tok = [-1] * L
        for j, st in enumerate(gen_steps):
            if st >= lo:
                noisy[P + j] = mask_id
            if j < len(s.completion_ids) and lo <= st <= hi:
                target[P + j] = True
                tok[P + j] = j
        if any(target):
            rows.append((noisy, target, tok))
    return clean, len(s.prompt_ids) + len(gen_ids), rows


def build_rows(samples: Sequence[Sample], block_size: int, mask_id: int, pad_id: int,
               shrink: int = 1) -> Rows:
    if shrink < 1:
        raise ValueError("shrink: must be >= 1")
    rows = pack_rows([_sample_rows(s, block_size, mask_id, shrink) for s in samples], pad_id, block_size)
    return with_bias(rows, samples)


def with_bias(rows: Rows, samples: Sequence[Sample]) -> Rows:
    """`rows` with each row's sample's logit_bias (its trace's) attached as `rows.bias` (None when no sample
    was generated with one): replay adds it to the logits as the sampler did."""
    biases = [getattr(s.trace, "logit_bias", None) for s in samples]
    if not any(biases):
        rows.bias = None
        return rows
    width = max(len(b or {}) for b in biases)
    pairs = torch.zeros(len(samples), width, 2, dtype=torch.float64)
    for i, b in enumerate(biases):
        for j, (tid, v) in enumerate((b or {}).items()):
            pairs[i, j, 0], pairs[i, j, 1] = float(tid), float(v)
    rows.bias = pairs[rows.row_sample]
    return rows


def dense_row_bias(pairs: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """(id, bias) pairs [N, K, 2] (Rows.bias, Rows.token_bias) -> the additive bias [N, V] fp32 (dllm.logit_bias)."""
    if pairs is None:
        return None
    return dense_bias(pairs[..., 0].long(), pairs[..., 1], vocab_size)


RowSpec = tuple[list[int], int, list[tuple[list[int], list[bool], list[int]]]]


class RowParts(NamedTuple):
    """One training row before padding (lists or 1-D tensors of one length n)."""

    noisy: Sequence[int] | torch.Tensor  # [n] the row's input ids
    clean: Sequence[int] | torch.Tensor  # [n] the text
    valid: int  # its first `valid` positions are keys
    target: Sequence[bool] | torch.Tensor  # [n] the positions scored in this row
    token_idx: Sequence[int] | torch.Tensor  # [n] a target's index in its sample (-1 elsewhere)
    sample: int  # which sample (text) the row replays


def stack_rows(parts: Sequence[RowParts], pad_id: int, width: int | None = None) -> Rows:
    """Rows padded on the right with `pad_id` to `width` columns (default: the longest row, 1 for none); the
    padding is neither valid nor a target. The one padding of replay, baseline and likelihood rows."""
    R = len(parts)
    L = width if width is not None else max((len(p.clean) for p in parts), default=1)
    noisy = torch.full((R, L), pad_id, dtype=torch.long)
    clean = torch.full((R, L), pad_id, dtype=torch.long)
    valid = torch.zeros(R, L, dtype=torch.bool)
    target = torch.zeros(R, L, dtype=torch.bool)
    sample_idx = torch.full((R, L), -1, dtype=torch.long)
    token_idx = torch.full((R, L), -1, dtype=torch.long)
    row_sample = torch.zeros(R, dtype=torch.long)
    for r, p in enumerate(parts):
        n = len(p.clean)
        noisy[r, :n] = torch.as_tensor(p.noisy)
        clean[r, :n] = torch.as_tensor(p.clean)
        valid[r, :p.valid] = True
        target[r, :n] = torch.as_tensor(p.target)
        token_idx[r, :n] = torch.as_tensor(p.token_idx)
        sample_idx[r, :n] = torch.where(target[r, :n], p.sample, -1)
        row_sample[r] = p.sample
    pos = torch.arange(L).expand(R, L).contiguous()
    return Rows(noisy, clean, pos, valid, target, sample_idx, token_idx, row_sample)


def pack_rows(per: Sequence[RowSpec], pad_id: int, empty_len: int = 1) -> Rows:
    """Rows from each sample's (clean ids, valid length, [(noisy, target, token index) per row]), padded
    to the longest (`empty_len` wide for no samples): the one packing of block-causal and full-attention replay rows."""
    parts = [RowParts(nz, clean, n, tg, tk, i) for i, (clean, n, rows) in enumerate(per) for nz, tg, tk in rows]
    return stack_rows(parts, pad_id, max((len(clean) for clean, _, _ in per), default=empty_len))


def bucket_length(length: int, block_size: int, smallest: int = 64) -> int:
    """The length bucket of a row of `length` tokens: the smallest of smallest * 2^k (rounded up to whole
    blocks) holding it -- a few shapes for a run of varying lengths (one compiled kernel's autotuning each)."""
    out = -(-smallest // block_size) * block_size
    while out < length:
        out *= 2
    return out


def pad_rows(rows: Rows, length: int, pad_id: int) -> Rows:
    """`rows` padded on the right to `length` columns (>= theirs): padding is neither valid (no key sees it)
    nor a target, so the loss, its gradients and every gathered value are those of the unpadded rows."""
    R, L = rows.clean.shape
    if length < L:
        raise ValueError(f"length: {length} is shorter than the rows ({L})")

    def pad(t: torch.Tensor, value: int | bool) -> torch.Tensor:
        return torch.cat([t, torch.full((R, length - L), value, dtype=t.dtype)], 1)

    return Rows(pad(rows.noisy, pad_id), pad(rows.clean, pad_id), torch.arange(length).expand(R, length).contiguous(),
                pad(rows.valid, False), pad(rows.target, False), pad(rows.sample_idx, -1), pad(rows.token_idx, -1),
                rows.row_sample, rows.bias)


def replay_hidden(model: Any, rows: Rows, device: torch.device | None = None) -> torch.Tensor:
    """The replay forward: hidden states [R, L, D] of the rows' noisy copies. `model` is an
    `SDARForCausalLM` or anything called like one with the training layout (a DeepSpeed engine
    wrapping it, whose forward keeps ZeRO-3 gradient accumulation right)."""
    dev = device if device is not None else getattr(model, "module", model).device
    return model(rows.noisy.to(dev), position_ids=rows.pos.to(dev), clean_ids=rows.clean.to(dev),
                 valid=rows.valid.to(dev), output="hidden")


@torch.no_grad()
def trace_hidden(model: Any, sample: Sample) -> torch.Tensor:
    """Hidden states [C, D] of each of the sample's C completion tokens at the denoising state that
    committed it, in completion order: `model.lm_head` of them gives the logits the decoder sampled
    from (before temperature / top-k / top-p). Apply it to a chunk at a time to bound memory."""
    rows = build_rows([sample], model.config.block_size, model.config.mask_token_id, pad_id=0)
    hidden = replay_hidden(model, rows)
    picked = hidden[rows.target.to(hidden.device)]  # [C, D], the rows' targets in row-major order
    out = torch.empty_like(picked)
    out[rows.token_idx[rows.target].to(out.device)] = picked
    return out


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask_id: int,
                   temperature: float = TEMPERATURE.default, bias: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, L, V], ids [R, L] -> log p(ids) [R, L] under the sampling distribution
    (logit_bias added: `bias` [R, V] from `dense_row_bias`, mask token excluded, divided by temperature), fp32.
    Also logits [N, V], ids [N], bias [N, V]."""
    logits = apply_bias(logits, bias)
    logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) == mask_id, float("-inf"))
    if temperature not in (0, 1.0):
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
