"""`logit_bias`: an additive bias on chosen tokens' logits at every denoising forward (OpenAI's field).

    bias = check_logit_bias({"5": -100, 7: 2.5}, vocab_size=64, mask_id=63)   # {5: -100.0, 7: 2.5}, or FieldError
    ids, values = padded(bias)                         # numpy [MAX_ENTRIES] each: (0, 0.0) after the entries
    logits = apply_bias(logits, dense_bias(ids_t, values_t, V))   # [N, B, V] + [N, V] -> biased fp32 logits
    x = add_pairs_(x, ids_t, values_t)                 # the same in place on [N, B, V], N B K entries (the step's)
    table = bias_rows([bias, None, ...], V, device)    # [n, V] fp32 (None when nobody is biased): replay's
    cols = bias_columns([bias, None])                  # [n, 2 MAX_ENTRIES] float64: the full-attention packed rows'

The bias is added to the raw logits before anything else of the sampling distribution (mask removal,
temperature, top-k / top-p), as vLLM's logits processor and OpenAI do: -100 effectively bans a token,
+100 effectively forces it. Every decoding path applies the same fp32 add (`dense_bias` + `apply_bias`),
and so does replay (the trace records the bias), so replayed log-probabilities equal the sampler's.

Static shapes: a step carries per sampled row (ids, values) padded to `MAX_ENTRIES` (id 0, value 0.0: adds
exactly nothing), whatever the row's bias, so a biased request never changes a compiled step's key or a
CUDA graph's shapes. The SDAR step scatter-adds them straight into its fp32 logits (`add_pairs_`: N x B x K
entries, no [N, V] tensor); `dense_bias` scatter-adds them into a zero [N, V] row (replay, the full-attention
rows). Ids are distinct within a row, so every vocabulary entry receives at most one non-zero term and both
are exact in any order, and bit-equal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from dllm.logit_bias_rules import BOUND, MAX_ENTRIES, check_logit_bias

__all__ = ["BOUND", "MAX_ENTRIES", "apply_bias", "bias_columns", "bias_rows", "biased_logits",
           "check_logit_bias", "dense_bias", "padded"]

LogitBias = dict[int, float]


def padded(bias: Mapping[int, float] | None, width: int = MAX_ENTRIES) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [width], values float64 [width]): the entries, then (0, 0.0) padding that adds nothing."""
    ids, values = np.zeros(width, dtype=np.int64), np.zeros(width, dtype=np.float64)
    if bias:
        assert len(bias) <= width, "check_logit_bias caps the entries"
        ids[:len(bias)] = list(bias)
        values[:len(bias)] = list(bias.values())
    return ids, values


def dense_bias(ids: torch.Tensor, values: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids [N, K] int64, values [N, K] -> the additive bias [N, V] fp32 (no host sync, static shapes)."""
    out = torch.zeros(ids.shape[0], vocab_size, dtype=torch.float32, device=ids.device)
    return out.scatter_add_(1, ids.long(), values.float())


def add_pairs_(x: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """x [N, B, V] fp32 (the caller's to change) += each row's (id, bias) pairs [N, K], in place: it touches
    N x B x K entries, not N x V. Bit-equal to `apply_bias` with `dense_bias` (ids are distinct within a row,
    padding adds 0.0), so the decode step's sampler and replay agree exactly."""
    B = x.shape[1]
    return x.scatter_add_(-1, ids.long()[:, None, :].expand(-1, B, -1), values.to(x.dtype)[:, None, :].expand(-1, B, -1))


def pairs_of(biases: Sequence[Mapping[int, float] | None],
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each item's (ids [n, K], values [n, K]) padded to the longest (K >= 1), or None when none has a bias."""
    if not any(biases):
        return None
    width = max(len(b or {}) for b in biases)
    cols = [padded(b, width) for b in biases]
    return (torch.from_numpy(np.stack([c[0] for c in cols])).to(device),
            torch.from_numpy(np.stack([c[1] for c in cols])).to(device))


def apply_bias(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """logits [N, ..., V] + bias [N, V] (broadcast over the middle dims) -> fp32 logits; None: logits.float()."""
    x = logits.float()
    if bias is None:
        return x
    return x + bias.view(bias.shape[0], *([1] * (x.dim() - 2)), bias.shape[-1])


def bias_rows(biases: Sequence[Mapping[int, float] | None], vocab_size: int,
              device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Each item's dense bias [n, V] fp32 (zeros for None), or None when no item has one: what replay adds."""
    if not any(biases):
        return None
    pairs = pairs_of(biases, device)
    return None if pairs is None else dense_bias(*pairs, vocab_size)


def bias_columns(biases: Sequence[Mapping[int, float] | None]) -> np.ndarray:
    """Each item's (ids, values) padded to MAX_ENTRIES as one float64 row [n, 2 MAX_ENTRIES] (ids are exact in
    float64): the full-attention decoder's packed rows end with them (dllm.step.width, dllm.step.row_bias)."""
    out = np.zeros((len(biases), 2 * MAX_ENTRIES), dtype=np.float64)
    for r, b in enumerate(biases):
        if b:
            out[r, :MAX_ENTRIES], out[r, MAX_ENTRIES:] = padded(b)
    return out


def biased_logits(logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]) -> torch.Tensor:
    """logits [N, ..., V] with each row's bias added (fp32), or unchanged when no row has one."""
    bias = bias_rows(biases, logits.shape[-1], logits.device)
    return logits if bias is None else apply_bias(logits, bias)
