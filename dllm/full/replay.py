"""Trace replay for full-attention models (TraceRL rows): mask every token of step >= s, score step s.

    rows = build_full_rows(samples, mask_id, pad_id, shrink=1)           # dllm.replay.Rows
    hidden = full_replay_hidden(model, rows)                               # [R, L, D] (Dream's shift applied)
    lp = token_logprobs(model.lm_head(hidden), rows.clean, mask_id,        # dllm.replay.token_logprobs (with
                        bias=dense_row_bias(rows.bias, V))                 # the traces' logit_bias)
    old = rows.gather(behaviour_logprobs_per_sample)                       # [R, L], zeros off-target
    logits = model.lm_head(full_trace_hidden(model, sample))               # [C, V] per completion token

A sample (rollout_client.Rollout, dllm GenerationOutput, a finished FullSequence) has `prompt_ids`,
`completion_ids` and a `trace` with `steps`, `tail_ids`, `tail_steps`, `block_size`, `prompt_len` and
`canvas_len`. Generated tokens (completion, then the tail of its last block) get a global step from the
Trace arithmetic (block, then step within the block; `shrink` merges neighbouring steps of a block). For
each global step g that commits a completion token there is ONE row: the canvas of `canvas_len`
positions (prompt, generated tokens, masks after them: the later blocks the decoder saw, masked), every
generated token with global step >= g masked, the completion tokens of step g the targets; full attention
over the canvas (`valid`). `rows.noisy` is that input, `rows.clean` the ids to score (the tokens as
sampled). Blocks start at the trace's `block_origin` (the prompt's end for LLaDA / Dream). With shrink 1
this is exactly what each denoising forward of the exact-mode decoder saw (dllm.full.decoding), so replay
reproduces the sampler's log-probabilities (fp32 < 1e-4). A prefix-cache trace's rows see what its forwards
saw: a block's first forward the whole canvas, its later ones [0, block end + `further_horizon`) (`valid`
ends there: positions past the horizon are invisible, as they were to the sampler); what remains between
replay and sampler is the cache's staleness (the prefix's K/V were computed at the block's first forward),
which the trainer measures per token and corrects (TIS / MIS).

Unlike SDAR's replay (several blocks' states packed into one row with a clean copy), full attention lets
every position see every other, so states cannot share a row: a sample costs one row per global step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dllm.full.schedule import window_end
from dllm.replay import Rows, Sample, pack_rows, trace_of, with_bias


def full_global_steps(prompt_len: int, block_size: int, steps: Sequence[int], shrink: int = 1,
                      block_origin: int = 0) -> list[int]:
    """Trace.global_steps for any list of per-token steps (completion + tail): block, then shrunk step (blocks
    start at absolute position `block_origin`: the prompt's length for LLaDA / Dream traces)."""
    if shrink < 1:
        raise ValueError(f"shrink: must be >= 1, got {shrink}")
    span = block_size + 1
    return [(prompt_len + j - block_origin) // block_size * span + -(-st // shrink) for j, st in enumerate(steps)]


def _canvas_len(s: Sample, n_gen: int, block_size: int) -> int:
    got = getattr(trace_of(s), "canvas_len", None)
    P = len(s.prompt_ids)
    least = P + n_gen
    if got is None:  # a trace without it: the generated tokens to whole blocks
        return -(-least // block_size) * block_size
    if not isinstance(got, int) or got < least:
        raise ValueError(f"trace.canvas_len: {got!r} is shorter than prompt + generated tokens ({least})")
    return got


def _visible(tr: Any, step: int, block_size: int, shrink: int, canvas_len: int) -> int:
    """How many positions the forward of global step `step` saw: the whole canvas, except a prefix-cache
    block's later forwards, which saw up to the block's end + further_horizon."""
    if getattr(tr, "cache_mode", None) != "prefix":
        return canvas_len
    block, shrunk = divmod(step, block_size + 1)
    if (shrunk - 1) * shrink + 1 == 1:  # the block's first forward: the whole canvas (it made the cache)
        return canvas_len
    block_end = getattr(tr, "block_origin", 0) + (block + 1) * block_size
    return window_end(block_end, canvas_len, getattr(tr, "further_horizon", None))


def _sample_rows(s: Sample, block_size: int, mask_id: int, shrink: int
                 ) -> tuple[list[int], list[tuple[list[int], list[bool], list[int]]], list[int]]:
    """-> the clean canvas of one sample, its rows (noisy ids, target flags, completion index) and how many
    positions each row sees."""
    tr = trace_of(s)
    P, C = len(s.prompt_ids), len(s.completion_ids)
    gen_ids = list(s.completion_ids) + list(tr.tail_ids)
    gen_steps = list(tr.steps) + list(tr.tail_steps)
    if len(tr.steps) != C or len(tr.tail_steps) != len(tr.tail_ids):
        raise ValueError(f"trace: {len(tr.steps)} steps for {C} completion tokens "
                         f"({len(tr.tail_steps)} tail steps for {len(tr.tail_ids)} tail ids)")
    L = _canvas_len(s, len(gen_ids), block_size)
    clean = list(s.prompt_ids) + gen_ids + [mask_id] * (L - P - len(gen_ids))
    g = full_global_steps(P, block_size, gen_steps, shrink, getattr(tr, "block_origin", 0))
    rows, visible = [], []
    for step in sorted(set(g[:C])):
        noisy = list(clean)
        target, tok = [False] * L, [-1] * L
        for j, gj in enumerate(g):
            if gj >= step:
                noisy[P + j] = mask_id
            if j < C and gj == step:
                target[P + j], tok[P + j] = True, j
        rows.append((noisy, target, tok))
        visible.append(_visible(tr, step, block_size, shrink, L))
    return clean, rows, visible


def build_full_rows(samples: Sequence[Sample], mask_id: int, pad_id: int, shrink: int = 1,
                    block_size: int | None = None) -> Rows:
    """TraceRL rows of full-attention samples (see the module docstring) as dllm.replay.Rows: `noisy` the
    forward's input, `clean` the ids scored, `valid` what the forward saw (the canvas; a prefix-cache
    block's later forwards: up to its horizon), `pos` 0..L-1. `block_size`: the traces' own unless given."""
    per = [_sample_rows(s, block_size or trace_of(s).block_size, mask_id, shrink)
           for s in samples]
    rows = pack_rows([(clean, len(clean), r) for clean, r, _ in per], pad_id)
    for r, n in enumerate(n for _, _, visible in per for n in visible):
        rows.valid[r, n:] = False
    return with_bias(rows, samples)


def full_replay_hidden(model: Any, rows: Rows, device: torch.device | None = None) -> torch.Tensor:
    """The replay forward: hidden states [R, L, D] of the rows (bidirectional over `valid`, Dream's shift
    applied: `model.lm_head` of row i scores token i). `model` is a FullAttentionLM or anything called
    like one (a DeepSpeed engine wrapping it)."""
    dev = device if device is not None else getattr(model, "module", model).device
    return model(rows.noisy.to(dev), position_ids=rows.pos.to(dev), valid=rows.valid.to(dev), output="hidden")


@torch.no_grad()
def full_trace_hidden(model: Any, sample: Sample, shrink: int = 1) -> torch.Tensor:
    """Hidden states [C, D] of each completion token at the denoising state that committed it, in
    completion order (`model.lm_head` of them: the logits the sampler used, before temperature etc.)."""
    cfg = model.config
    rows = build_full_rows([sample], cfg.mask_token_id, cfg.pad_token_id or 0, shrink=shrink)
    hidden = full_replay_hidden(model, rows)
    picked = hidden[rows.target.to(hidden.device)]
    out = torch.empty_like(picked)
    out[rows.token_idx[rows.target].to(out.device)] = picked
    return out
