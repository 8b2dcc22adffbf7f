"""The decoding Trace: how each generated token was committed (docs/DESIGN.md contract).

For completion token j: `steps[j]` is the 1-based index, within its block, of the
denoising forward that committed it, and `logprobs[j]` the log-probability of that
token under the distribution it was sampled from (after temperature/top-k/top-p).
Blocks are aligned to absolute position 0 of prompt + completion.

`FinishReason` is why a sequence ended: a `str` enum, so it is its plain string on the wire
and in stores ("stop", "length", "abort", "error").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"        # an eos / stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's max length reached
    ABORT = "abort"      # aborted: client gone, deadline, pause with abort_inflight, shutdown
    ERROR = "error"      # the decoder failed this sequence alone (`seq.error` says why)


@dataclass
class Trace:
    prompt_len: int
    block_size: int
    steps: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int = 0
    finish_reason: FinishReason | None = None
    tail_ids: list[int] = field(default_factory=list)  # last block's tokens after the truncation point
    tail_steps: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        return cls(**{k: d[k] for k in ("prompt_len", "block_size", "steps", "logprobs", "version",
                                        "finish_reason", "tail_ids", "tail_steps") if k in d})
