"""The decoding Trace: how each generated token was committed (docs/DESIGN.md contract).

For completion token j: `steps[j]` is the 1-based index, within its block, of the
denoising forward that committed it, and `logprobs[j]` the log-probability of that
token under the distribution it was sampled from (after temperature/top-k/top-p).
Blocks start at absolute position `block_origin` of prompt + completion: 0 for block-causal SDAR
(aligned to position 0, a prompt's last partial block is completed first), the prompt's length for
full-attention LLaDA / Dream (blocks start at the prompt's end, as their official rollouts decode).
Full-attention decoding (dllm.full) adds `cache_mode` ("exact" / "prefix"), `canvas_len` (the length
of the sequence every denoising forward saw: later blocks were there, masked), `schedule` (the static
transfer schedule: "llada" or "dream eps=0.001") and `further_horizon` (prefix mode: the positions after
the block that a block's later forwards saw; None: the rest of the canvas).

One type from decoder to trainer: the decoder fills it in, the server sends it as JSON (the
wire schemas of `rollout_client` use it as is), and it is the one home of the block/step
arithmetic (used by replay, advantages and metrics). Torch-free (pydantic only).

    trace = Trace(prompt_len=3, block_size=4, steps=[1, 1, 2], logprobs=[-0.1, -0.5, -0.2])
    trace.global_steps(shrink=2), trace.num_forwards, trace.model_dump()

A trace-free trace (`trace_free=True`, e.g. from the lmdeploy backend, which reports no
per-token steps) keeps the token count but its steps and logprobs are 0s; `backend` names
the runner that produced it. Both fields default to the native engine's (wire compatible).

`FinishReason` is why a sequence ended: a `str` enum, so it is its plain string on the wire
and in stores ("stop", "length", "abort", "error").
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class FinishReason(StrEnum):
    STOP = "stop"        # an eos / stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's max length reached
    ABORT = "abort"      # aborted: client gone, deadline, pause with abort_inflight, shutdown
    ERROR = "error"      # the decoder failed this sequence alone (`seq.error` says why)


class Trace(BaseModel):
    """How each generated token was committed (docs/DESIGN.md: steps are 1-based within each block);
    the one home of its block/step arithmetic (used by replay, advantages and metrics)."""

    prompt_len: int
    block_size: int
    steps: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    version: int = 0
    finish_reason: FinishReason | None = None
    tail_ids: list[int] = Field(default_factory=list)  # last block's tokens after the truncation point
    tail_steps: list[int] = Field(default_factory=list)
    # full-attention models (dllm.full) only; None for block-causal SDAR (and absent from older traces):
    cache_mode: str | None = None  # "exact" (every forward recomputes every position) or "prefix" (Fast-dLLM)
    canvas_len: int | None = None  # positions every forward saw: the prompt, then max_tokens to whole blocks
    block_origin: int = 0  # absolute position where the first block starts (SDAR 0; LLaDA / Dream: prompt_len)
    schedule: str | None = None  # full attention: static decoding's transfer schedule ("llada", "dream eps=0.001")
    further_horizon: int | None = None  # prefix mode: positions after the block a block's later forwards saw
    # {token id: bias} added to the logits at every forward (the request's logit_bias); replay adds it too
    logit_bias: dict[int, float] | None = None
    # True: the engine could not report how tokens were committed (steps and logprobs are 0s, not a
    # trace): objectives that replay traces refuse it; random masking / coupled RL train from it
    trace_free: bool = False
    backend: str = ""  # the runner that generated it, when it is not the native one (named in refusals)

    def published(self, finish_reason: FinishReason | None = None) -> Trace:
        """A copy to hand out (responses, records): a trace-free one carries 0 steps and logprobs,
        never the decoder's own numbers (a withheld trace stays withheld)."""
        update: dict[str, object] = {"finish_reason": finish_reason or self.finish_reason}
        if self.trace_free:
            update |= {"steps": [0] * len(self.steps), "logprobs": [0.0] * len(self.logprobs),
                       "tail_steps": [0] * len(self.tail_steps)}
        return self.model_copy(update=update, deep=True)

    def block_of(self, j: int) -> int:
        """Block index of generated token j (blocks start at absolute position `block_origin`)."""
        return (self.prompt_len + j - self.block_origin) // self.block_size

    def global_steps(self, shrink: int = 1) -> list[int]:
        """Per completion token: an id of the denoising forward that committed it, increasing
        in decoding order (block, then step within the block). With `shrink` s, steps
        (k-1)s+1..ks of a block count as one step k (TraceRL's shrunk trajectory)."""
        if shrink < 1:
            raise ValueError(f"shrink: must be >= 1, got {shrink}")
        span = self.block_size + 1  # steps within a block are 1..block_size
        return [self.block_of(j) * span + -(-st // shrink) for j, st in enumerate(self.steps)]

    @property
    def num_forwards(self) -> int:
        """Denoising forwards that committed the generated tokens (the tail included)."""
        gen = self.steps + self.tail_steps
        return len({(self.block_of(j), st) for j, st in enumerate(gen)})
