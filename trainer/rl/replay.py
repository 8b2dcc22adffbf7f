"""Training rows beyond the exact trace replay, and memory-bounded scoring of them.

The replay itself -- rebuilding every denoising state of a trace as noisy + clean rows,
the replay forward and the log-probs it reproduces (the DESIGN's replay invariant) -- is
`dllm.replay`, shared with the server. Here: `completion_rows` (one clean row per sample,
for the random-masking / coupled baselines, which draw their own masks), and
`chunked_token_logprobs` / `token_entropy` (full-vocabulary logits for a chunk of scored
tokens at a time, ZeRO-3 safe).

    rows = completion_rows(rollouts, block_size, pad_id)
    lp, ent, anchor = chunked_token_logprobs(model.lm_head, hidden[rows.target], ids, mask_id)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dllm.ranges import TEMPERATURE
from dllm.replay import (
    RowParts,
    Rows,
    Sample,
    dense_row_bias,
    stack_rows,
    token_logprobs,
    trace_of,
    with_bias,
)


def completion_rows(samples: Sequence[Sample], block_size: int, pad_id: int) -> Rows:
    """One clean row per sample whose targets are all its completion tokens (for the
    random-masking / coupled baselines, which draw their own masks)."""
    seqs = [list(s.prompt_ids) + list(s.completion_ids) + list(trace_of(s).tail_ids) for s in samples]
    L = math.ceil(max(map(len, seqs), default=1) / block_size) * block_size
    parts = []
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        P, C = len(s.prompt_ids), len(s.completion_ids)
        tail = len(seq) - P - C
        parts.append(RowParts(seq, seq, len(seq), [False] * P + [True] * C + [False] * tail,
                              [-1] * P + list(range(C)) + [-1] * tail, i))
    return with_bias(stack_rows(parts, pad_id, L), samples)


LMHead = Callable[[torch.Tensor], torch.Tensor]  # hidden [C, D] -> logits [C, V]


def _chunk_logprobs(lm_head: LMHead, hidden: torch.Tensor, ids: torch.Tensor, mask_id: int, temperature: float,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [C, D], ids [C], bias [C, K, 2] (logit_bias pairs, Rows.token_bias) -> (log p(ids) [C] fp32,
    entropy [C] detached), under the biased logits the sampler drew from."""
    logits = lm_head(hidden).float()  # [C, V]: the only place full-vocabulary logits exist
    dense = dense_row_bias(bias, logits.shape[-1])
    lp = token_logprobs(logits, ids, mask_id, temperature, bias=dense)
    return lp, token_entropy(logits.detach() if dense is None else logits.detach() + dense, mask_id)


def chunked_token_logprobs(lm_head: LMHead, hidden: torch.Tensor, ids: torch.Tensor, mask_id: int,
                           temperature: float = TEMPERATURE.default, chunk: int = 1024, num_chunks: int | None = None,
                           filler: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like `token_logprobs(lm_head(hidden), ids)` for scored tokens only: hidden [N, D], ids [N]
    -> (log-probs [N], entropy [N] without grad, anchor). Full-vocabulary logits exist for `chunk`
    tokens at a time, in forward and (recomputed, activation-checkpointing style) in backward,
    so peak memory is bounded by the chunk instead of N x vocab (chunk 0: one chunk).

    `num_chunks` (>= the chunks N needs) makes exactly that many `lm_head` calls, padding with
    one-token chunks of `filler` [1, D]: under ZeRO-3 every rank must call `lm_head` equally
    often. `anchor` is a zero that depends on those calls: add it to the loss so the backward
    reaches them (and so a rank with N = 0 still has a loss with a graph). `bias` [N, K, 2]: each token's
    logit_bias pairs (Rows.token_bias), added to its logits as the sampler did."""
    n = hidden.shape[0]
    step = chunk if chunk > 0 else max(n, 1)
    need = -(-n // step)
    total = need if num_chunks is None else num_chunks
    if total < need:
        raise ValueError(f"num_chunks: {total} chunks of {step} cannot hold {n} tokens")
    checkpointed = torch.is_grad_enabled() and hidden.requires_grad

    def run(h: torch.Tensor, t: torch.Tensor, b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(_chunk_logprobs, lm_head, h, t, mask_id, temperature, b,
                                                     use_reentrant=False)
        return _chunk_logprobs(lm_head, h, t, mask_id, temperature, b)

    lps, ents = [], []
    anchor = hidden.new_zeros((), dtype=torch.float32)
    for i in range(total):
        if i < need:
            lp, ent = run(hidden[i * step:(i + 1) * step], ids[i * step:(i + 1) * step],
                          None if bias is None else bias[i * step:(i + 1) * step])
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
