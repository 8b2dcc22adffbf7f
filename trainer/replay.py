"""Trace replay: rebuild every denoising state of a rollout as training rows.

For block models the state of step k of a block is: clean prefix (earlier blocks),
the block's tokens committed at steps < k visible, the rest masked. Blocks only see
clean earlier blocks, so the k-th states of all blocks of a sequence pack into ONE row
of the noisy-copy + clean-copy layout: a sequence costs at most max-steps-per-block rows.
Shrinkage `s` merges s neighbouring steps (row r holds steps r*s+1..(r+1)*s, scored
under the state before step r*s+1); s=1 is exact.

Replay invariant (docs/DESIGN.md): under the same weights, `token_logprobs` of row targets
equals the trace's behaviour logprobs (fp32, temperature 1, no top-k/top-p).

A sample is anything with `prompt_ids`, `completion_ids` and a `trace` (`steps`, `tail_ids`,
`tail_steps`), the `Sample` protocol: a `rollout_client.Rollout` straight off the wire, or a
`dllm.decoding.GenerationOutput`.

    rows = build_rows(rollouts, block_size, mask_id, pad_id, shrink=1)
    logits = model.forward_train(rows.noisy, rows.clean, rows.pos, rows.valid)
    lp = token_logprobs(logits, rows.clean, mask_id)        # [R, L]
    old = rows.gather(behaviour_logprobs_per_sample)        # [R, L], zeros off-target
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class SampleTrace(Protocol):
    """The part of a decoding trace replay reads (dllm.trace.Trace, rollout_client.protocol.TraceModel)."""

    @property
    def steps(self) -> Sequence[int]: ...  # per completion token: its 1-based step within its block
    @property
    def tail_ids(self) -> Sequence[int]: ...  # last block's tokens after the truncation point
    @property
    def tail_steps(self) -> Sequence[int]: ...


class Sample(Protocol):
    """What replay needs of a generated sample (rollout_client.Rollout, dllm.sequence.GenerationOutput)."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...
    @property
    def completion_ids(self) -> Sequence[int]: ...
    @property
    def trace(self) -> SampleTrace | None: ...  # None: generated without return_trace, cannot be replayed


def _trace(s: Sample) -> SampleTrace:
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
    P, tr = len(s.prompt_ids), _trace(s)
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
    per = [_sample_rows(s, block_size, mask_id, shrink) for s in samples]
    R = sum(len(rows) for _, _, rows in per)
    L = max((len(clean) for clean, _, _ in per), default=block_size)
    noisy = torch.full((R, L), pad_id, dtype=torch.long)
    clean_t = torch.full((R, L), pad_id, dtype=torch.long)
    valid = torch.zeros(R, L, dtype=torch.bool)
    target = torch.zeros(R, L, dtype=torch.bool)
    sample_idx = torch.full((R, L), -1, dtype=torch.long)
    token_idx = torch.full((R, L), -1, dtype=torch.long)
    row_sample = torch.zeros(R, dtype=torch.long)
    r = 0
    for i, (clean, n, rows) in enumerate(per):
        for nz, tg, tk in rows:
            ln = len(clean)
            noisy[r, :ln] = torch.tensor(nz)
            clean_t[r, :ln] = torch.tensor(clean)
            valid[r, :n] = True
            target[r, :ln] = torch.tensor(tg)
            token_idx[r, :ln] = torch.tensor(tk)
            sample_idx[r, :ln] = torch.where(target[r, :ln], i, -1)
            row_sample[r] = i
            r += 1
    pos = torch.arange(L).expand(R, L).contiguous()
    return Rows(noisy, clean_t, pos, valid, target, sample_idx, token_idx, row_sample)


def completion_rows(samples: Sequence[Sample], block_size: int, pad_id: int) -> Rows:
    """One clean row per sample whose targets are all its completion tokens (for the
    random-masking / coupled baselines, which draw their own masks)."""
    n = len(samples)
    seqs = [list(s.prompt_ids) + list(s.completion_ids) + list(_trace(s).tail_ids) for s in samples]
    L = math.ceil(max(map(len, seqs), default=1) / block_size) * block_size
    clean = torch.full((n, L), pad_id, dtype=torch.long)
    valid = torch.zeros(n, L, dtype=torch.bool)
    target = torch.zeros(n, L, dtype=torch.bool)
    sample_idx = torch.full((n, L), -1, dtype=torch.long)
    token_idx = torch.full((n, L), -1, dtype=torch.long)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        P, C = len(s.prompt_ids), len(s.completion_ids)
        clean[i, :len(seq)] = torch.tensor(seq)
        valid[i, :len(seq)] = True
        target[i, P:P + C] = True
        sample_idx[i, P:P + C] = i
        token_idx[i, P:P + C] = torch.arange(C)
    pos = torch.arange(L).expand(n, L).contiguous()
    return Rows(clean.clone(), clean, pos, valid, target, sample_idx, token_idx, torch.arange(n))


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask_id: int,
                   temperature: float = 1.0) -> torch.Tensor:
    """logits [R, L, V], ids [R, L] -> log p(ids) [R, L] under the sampling distribution
    (mask token excluded, divided by temperature), fp32."""
    logits = logits.float()
    logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) == mask_id, float("-inf"))
    if temperature not in (0, 1.0):
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None]).squeeze(-1)


def _chunk_logprobs(lm_head, hidden: torch.Tensor, ids: torch.Tensor, mask_id: int, temperature: float):
    """hidden [C, D], ids [C] -> (log p(ids) [C] fp32, entropy [C] detached)."""
    logits = lm_head(hidden).float()  # [C, V]: the only place full-vocabulary logits exist
    lp = token_logprobs(logits, ids, mask_id, temperature)
    return lp, token_entropy(logits.detach(), mask_id)


def chunked_token_logprobs(lm_head, hidden: torch.Tensor, ids: torch.Tensor, mask_id: int,
                           temperature: float = 1.0, chunk: int = 1024, num_chunks: int | None = None,
                           filler: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like `token_logprobs(lm_head(hidden), ids)` for scored tokens only: hidden [N, D], ids [N]
    -> (log-probs [N], entropy [N] without grad, anchor). Full-vocabulary logits exist for `chunk`
    tokens at a time, in forward and (recomputed, activation-checkpointing style) in backward,
    so peak memory is bounded by the chunk instead of N x vocab (chunk 0: one chunk).

    `num_chunks` (>= the chunks N needs) makes exactly that many `lm_head` calls, padding with
    one-token chunks of `filler` [1, D]: under ZeRO-3 every rank must call `lm_head` equally
    often. `anchor` is a zero that depends on those calls: add it to the loss so the backward
    reaches them (and so a rank with N = 0 still has a loss with a graph)."""
    n = hidden.shape[0]
    step = chunk if chunk > 0 else max(n, 1)
    need = -(-n // step)
    total = need if num_chunks is None else num_chunks
    if total < need:
        raise ValueError(f"num_chunks: {total} chunks of {step} cannot hold {n} tokens")
    checkpointed = torch.is_grad_enabled() and hidden.requires_grad

    def run(h, t):
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(_chunk_logprobs, lm_head, h, t, mask_id, temperature,
                                                     use_reentrant=False)
        return _chunk_logprobs(lm_head, h, t, mask_id, temperature)

    lps, ents = [], []
    anchor = hidden.new_zeros((), dtype=torch.float32)
    for i in range(total):
        if i < need:
            lp, ent = run(hidden[i * step:(i + 1) * step], ids[i * step:(i + 1) * step])
            lps.append(lp)
            ents.append(ent)
        else:  # padding call: same collectives as a real chunk, contributes exactly 0
            src = filler if filler is not None else hidden[:1]
            lp, _ = run(src * 0, torch.zeros(src.shape[0], dtype=torch.long, device=src.device))
            anchor = anchor + lp.sum() * 0
    if n and lps:
        anchor = anchor + lps[0].sum() * 0
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return (torch.cat(lps) if lps else empty), (torch.cat(ents) if ents else empty), anchor


def token_entropy(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    logits = logits.float().masked_fill(
        torch.arange(logits.shape[-1], device=logits.device) == mask_id, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * torch.where(torch.isinf(logp), 0.0, logp)).sum(-1)
