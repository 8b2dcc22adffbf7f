"""Post-processing of a decode step: a completed block joins the completion, checked against stop ids,
stop strings and max_tokens; a row whose probabilities were not finite ends its sequence.

    post = Postprocessor(eos_ids=[0], tokenizer=tok, max_len=4096, block_size=4)
    out = runner.run(batch)                     # dllm.runner.BlockRunner: the device step
    ended = post.decide(out.outputs)            # [Ended(seq, reason, error)]: which ended, and why

Host-only work on plain `dllm.sequence.Sequence` data, run by the scheduler after each step
(dllm.scheduler.Scheduler.postprocess, for the server and `dllm.decoding.generate` alike): it
commits blocks into the completion and the trace, and says which sequences ended and why; the
scheduler writes their finish reason (its one writer), for the block-causal and the full-attention
runners alike. It owns the text of each sequence (`seq.text`, decoded incrementally by `dllm.detokenize.TextStream`
with the tokenizer given here: one instance per thread).
"""

from __future__ import annotations

from collections import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dllm.detokenize import TextStream
from dllm.sequence import Sequence
from dllm.trace import FinishReason

if TYPE_CHECKING:
    import torch


@dataclass
class SeqOutput:
    """One sequence's outcome of a forward: its block (seq.block_ids / block_steps / block_logprobs, the
    committed tokens with their steps and log-probabilities) is updated in place; `ok` is False when its
    probabilities were not finite (the block is then unchanged)."""

    seq: Sequence
    ok: bool


@dataclass
class StepOutput:
    """What one forward of a runner hands back: per sequence its outcome, in batch order."""

    outputs: list[SeqOutput]
    num_committed: int  # tokens committed by the forward (unmasked), over the batch


@dataclass
class Ended:
    """A sequence the post-processor ended, and why (the scheduler writes it: `Scheduler._end`)."""

    seq: Sequence
    reason: FinishReason
    error: str | None = None  # why it failed (reason "error")


def apply_step(seqs: abc.Sequence[Sequence], out: torch.Tensor, B: int, mask_id: int,
               num_masked_before: int) -> StepOutput:
    """A step's packed float64 result on the host (per row: B ids, B steps, B log-probs, ok: the
    full-attention runner's layout, dllm.full.runner) written into each sequence's block; a row that
    is not ok leaves it unchanged."""
    ids, steps = out[:, :B].long().tolist(), out[:, B:2 * B].long().tolist()
    logprobs, is_ok = out[:, 2 * B:3 * B].tolist(), out[:, 3 * B].bool().tolist()
    outputs = []
    for r, s in enumerate(seqs):
        s.num_forwards += 1
        s.step_in_block += 1
        if is_ok[r]:
            s.block_ids, s.block_steps, s.block_logprobs = ids[r], steps[r], logprobs[r]
            s.block_done = mask_id not in s.block_ids
        outputs.append(SeqOutput(s, bool(is_ok[r])))
    after = sum(len(s.masked_positions()) for s in seqs if not s.block_done)
    return StepOutput(outputs, num_masked_before - after)


class Postprocessor:
    """Stop ids (eos, or a request's stop_token_ids), stop strings and max_tokens; the finish reason."""

    def __init__(self, *, eos_ids: Iterable[int], tokenizer: Any, max_len: int, block_size: int):
        self.eos_ids, self.tokenizer = set(eos_ids), tokenizer
        self.max_len, self.block_size = max_len, block_size
        self.num_tokens = 0  # completion tokens committed so far
        self.text_for_stops_only = False  # True: only sequences with stop strings are decoded to text (the
        # server's engine core: its API processes detokenise what they send, server.core.client)

    def decide(self, outputs: Iterable[SeqOutput]) -> list[Ended]:
        """Apply one step's outputs (completed blocks committed); returns the sequences that ended and why
        (failed ones first, in order). Writes no finish reason: the scheduler does."""
        failed, finished = [], []
        for out in outputs:
            s = out.seq
            if not out.ok:
                failed.append(Ended(s, FinishReason.ERROR, failure(s)))
            elif s.block_done:
                reason = self.commit_block(s)
                if reason is not None:
                    finished.append(Ended(s, reason, s.error if reason == FinishReason.ERROR else None))
        return failed + finished

    def commit_block(self, s: Sequence) -> FinishReason | None:
        """Move the completed block into the completion; apply stop ids, stop strings, max_tokens; returns
        why the sequence ends here (None: it goes on)."""
        first = max(0, len(s.prompt_ids) - s.block_start)
        new_ids = s.block_ids[first:]
        new_steps, new_lp = s.block_steps[first:], s.block_logprobs[first:]
        p = s.params
        keep, reason = len(new_ids), None
        stop_ids = self.eos_ids if p.stop_token_ids is None else set(p.stop_token_ids)
        if not p.ignore_eos and not stop_ids.isdisjoint(new_ids):
            keep, reason = next(i for i, t in enumerate(new_ids) if t in stop_ids) + 1, FinishReason.STOP
        room = p.max_tokens - len(s.completion_ids)
        if s.text_stream is None and self.tokenizer is not None and (p.stop or not self.text_for_stops_only):
            s.text_stream = TextStream(self.tokenizer, p.stop)
        if s.text_stream is not None:
            n = s.text_stream.push(new_ids[:min(keep, room)])  # decodes only the new tokens
            s.text = s.text_stream.text
            if n is not None:
                keep, reason = n, FinishReason.STOP
        if keep > room or (keep == room and reason is None):
            keep, reason = room, FinishReason.LENGTH
        s.completion_ids += new_ids[:keep]
        s.trace.steps += new_steps[:keep]
        s.trace.logprobs += new_lp[:keep]
        self.num_tokens += keep
        if reason is None and s.end_pos + self.block_size > self.max_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            s.trace.tail_ids = new_ids[keep:]
            s.trace.tail_steps = new_steps[keep:]
        return reason


def failure(s: Sequence) -> str:
    """Why a sequence whose probabilities were not finite ends (finish_reason "error")."""
    p = s.params
    return (f"sampling failed: the model's probabilities for this sequence are not finite "
            f"(temperature={p.temperature}, top_k={p.top_k}, top_p={p.top_p})")
