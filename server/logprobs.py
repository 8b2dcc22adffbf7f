"""Top-k alternatives of each generated token, by replaying its decoding trace (OpenAI logprobs).

    top = top_logprobs(model, seq, k=5)    # engine thread, right after `seq` finished
    top[j]  # [(token id, logprob), ...]: the k most likely tokens of the sampling distribution
            # at the denoising forward that committed completion token j, best first

The trace says which forward committed each token (`steps[j]`, 1-based within its block),
so the state of that forward is: the clean prefix before the block, the block's prompt
tokens and the tokens committed at earlier steps visible, everything else masked. One
dense block-causal forward per distinct (block, step) state -- rows batched, padded with
whole blocks after the state, which block-causal attention never lets earlier positions
see -- reproduces the logits the decoder sampled from (the DESIGN's replay invariant), and
`dllm.sampling.sampling_logprobs` applies the request's temperature / top-k / top-p.
Runs in the engine thread while the sequence's weights are still served: it costs one
extra forward per state, so only requests that ask for top logprobs pay it.
"""

from __future__ import annotations

from typing import Any

import torch

from dllm.attention import MaskSpec
from dllm.sampling import sampling_logprobs

MAX_ROWS = 16  # states per forward


def _states(seq: Any) -> tuple[list[int], list[int], dict[tuple[int, int], list[int]]]:
    """Full ids and steps (0 = prompt) of prompt + completion + tail, and the completion
    indices j grouped by the (block start, step) state that committed them."""
    B, P = seq.block_size, len(seq.prompt_ids)
    ids = list(seq.prompt_ids) + list(seq.completion_ids) + list(seq.trace.tail_ids)
    steps = [0] * P + list(seq.trace.steps) + list(seq.trace.tail_steps)
    groups: dict[tuple[int, int], list[int]] = {}
    for j in range(len(seq.completion_ids)):
        groups.setdefault(((P + j) // B * B, steps[P + j]), []).append(j)
    return ids, steps, groups


@torch.no_grad()
def top_logprobs(model: Any, seq: Any, k: int) -> list[list[tuple[int, float]]]:
    """For every completion token: the k most likely (id, logprob) of its sampling distribution."""
    B, P, mask_id = seq.block_size, len(seq.prompt_ids), seq.mask_id
    ids, steps, groups = _states(seq)
    out: list[list[tuple[int, float]]] = [[] for _ in seq.completion_ids]
    keys = sorted(groups)
    dev = model.device
    for first in range(0, len(keys), MAX_ROWS):
        chunk = keys[first:first + MAX_ROWS]
        L = max(start for start, _ in chunk) + B
        rows = torch.full((len(chunk), L), mask_id, dtype=torch.long)
        for r, (start, step) in enumerate(chunk):
            rows[r, :start] = torch.tensor(ids[:start], dtype=torch.long)
            for p in range(start, min(start + B, len(ids))):
                if steps[p] < step:  # prompt tokens (step 0) and earlier commits are visible
                    rows[r, p] = ids[p]
        pos = torch.arange(L).expand(len(chunk), L).to(dev)
        hidden = model.hidden_states(rows.to(dev), MaskSpec(pos, pos, B))  # [R, L, D]
        idx = torch.stack([torch.arange(start, start + B) for start, _ in chunk]).to(dev)  # [R, B]
        block_hidden = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))  # [R, B, D]
        logits = model.lm_head(block_hidden)  # [R, B, V]
        for r, key in enumerate(chunk):
            logp = sampling_logprobs(logits[r], seq.params, mask_id)  # [B, V]
            values, top_ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # [B, k]
            for j in groups[key]:
                off = P + j - key[0]
                out[j] = [(int(t), float(v)) for t, v in zip(top_ids[off], values[off]) if v > float("-inf")]
    return out
