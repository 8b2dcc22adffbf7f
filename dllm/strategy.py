"""The decoding strategies of block diffusion: which masked positions a denoising forward commits.

Torch-free (the wire schemas of `rollout_client` and the configs use it without the model stack).
A `str` enum: a member equals, hashes and prints as its value, so `"static"` and
`Strategy.static` are interchangeable and the JSON wire carries the plain string.

    Strategy("dynamic").code        # 1: its number in the batched commit rule (dllm.commit)
    StrategyField                   # the pydantic field type: takes "static" even in strict models

The rules themselves are in `dllm.commit`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Strict


class Strategy(StrEnum):
    """Which masked positions a denoising step commits. static: the k most confident; dynamic: every one
    above the confidence threshold (at least the k most confident); sequential: the k leftmost."""

    # member names are their values: an Enum hashes by name, so the member and its string hash alike
    static = "static"
    dynamic = "dynamic"
    sequential = "sequential"

    @property
    def code(self) -> int:
        """Its number in the batched commit rule (a tensor of codes, one per sequence)."""
        return _CODES[self]


_CODES = {s: i for i, s in enumerate(Strategy)}

# strict pydantic models refuse a plain string for an enum (Python input): this field takes the value
StrategyField = Annotated[Strategy, Strict(False)]


def transfer_schedule(num_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` forwards for a block with `num_masked` masks."""
    steps = max(1, min(steps, num_masked))
    base, rem = divmod(num_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]
