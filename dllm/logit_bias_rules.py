"""The rules of a request's `logit_bias` (torch-free: the wire schemas check with them too; dllm.logit_bias applies it).

    check_logit_bias({"5": -100, 7: 2.5})                          # {5: -100.0, 7: 2.5}: the shape only
    check_logit_bias(bias, vocab_size=64, mask_id=63)             # and the ids against the model (dllm.intake)

A FieldError("logit_bias", why) for: a key that is not a non-negative integer (or its decimal string, as
JSON objects spell OpenAI's token ids), an id outside the vocabulary or the mask token, a bias that is not
a finite number in [-BOUND, BOUND] (OpenAI's [-100, 100]), more than MAX_ENTRIES entries (300: OpenAI's
practical limit; every decode step carries that many (id, bias) slots per row, dllm.logit_bias).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from dllm.errors import FieldError

MAX_ENTRIES = 300  # OpenAI's practical limit on logit_bias entries; the width of every step's bias columns
BOUND = 100.0  # |bias| <= 100, OpenAI's bounds


def check_logit_bias(bias: object, vocab_size: int | None = None,
                     mask_id: int | None = None) -> dict[int, float] | None:
    """{token id (int or its decimal string): bias} -> {int: float}, None when empty; FieldError("logit_bias")
    for a non-integer key, an id outside the vocabulary or the mask id, a bias that is not a finite number in
    [-100, 100], or more than MAX_ENTRIES entries. Without vocab_size / mask_id only the shape is checked."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise FieldError("logit_bias", f"must be an object {{token id: bias}}, got {type(bias).__name__}")
    if len(bias) > MAX_ENTRIES:
        raise FieldError("logit_bias", f"at most {MAX_ENTRIES} entries, got {len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        tid = _token_id(key)
        if vocab_size is not None and not 0 <= tid < vocab_size:
            raise FieldError("logit_bias", f"token id {tid} is outside the vocabulary (0..{vocab_size - 1})")
        if mask_id is not None and tid == mask_id:
            raise FieldError("logit_bias", f"token id {tid} is the mask token, which is never sampled")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -BOUND <= value <= BOUND:
            raise FieldError("logit_bias", f"the bias of token {tid} must be a finite number in [-{BOUND:g}, "
                                           f"{BOUND:g}], got {value!r}")
        if tid in out:
            raise FieldError("logit_bias", f"token id {tid} is given twice")
        out[tid] = float(value)
    return out or None


def _token_id(key: object) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        tid = key
    elif isinstance(key, str) and key.strip().lstrip("-").isdigit() and key.strip().isascii():
        tid = int(key)
    else:
        raise FieldError("logit_bias", f"keys must be token ids (integers), got {key!r}")
    if tid < 0:
        raise FieldError("logit_bias", f"token ids are >= 0, got {tid}")
    return tid
