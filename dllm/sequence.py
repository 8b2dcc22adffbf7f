"""Sequence: the decoding state of one sample, and what a finished one hands back.

    seq = Sequence(prompt_ids, SamplingParams(max_tokens=32), block_size=4, mask_id=63)
    seq.block_ids, seq.block_steps, seq.block_logprobs     # the block being denoised (host mirror)
    seq.completion_ids, seq.text, seq.trace, seq.finish_reason, seq.error
    to_output(seq) -> GenerationOutput

Plain data with one writer per part: the scheduler (dllm.scheduler) moves its `status`
(`SeqStatus`) and writes `finish_reason` (stored once, in the trace: `seq.finish_reason` reads and
writes `seq.trace.finish_reason`); its block manager (dllm.block_manager) writes `slot`,
`block_table` (the KV pages it holds, page j = positions [j B, (j + 1) B)), `num_cached_tokens`
(the prefix whose K/V were found in the prefix cache) and `prefix_keys`; the runner
(dllm.runner) advances the block being denoised, and `dllm.postprocess.Postprocessor` commits
finished blocks into the completion and the trace. `seed` keys the sequence's sampling noise
(the request seed, else drawn from torch's global generator); `pending` holds clean tokens just
before the current block whose K/V the cache does not have yet (new prompt blocks, a
just-finished block, a preempted sequence's prefix) and that the runner's next forward writes.

    NEW -> WAITING -> RUNNING -> FINISHED    (RUNNING -> WAITING: preempted; the server adds RELEASING)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from dllm.detokenize import TextStream
from dllm.sampling_params import SamplingParams, param_row
from dllm.strategy import Strategy, transfer_schedule
from dllm.trace import FinishReason, Trace

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ids = itertools.count()


def _draw_seed() -> int:
    """An unseeded sequence's noise key, from torch's global generator (torch.manual_seed makes it repeatable);
    imported here, not at the top: the API processes of `dlrl serve` build sequences without torch."""
    import torch

    return int(torch.randint(1 << 62, ()))


class SeqStatus(StrEnum):
    NEW = "new"              # made and validated, not scheduled yet
    WAITING = "waiting"      # in the scheduler's queue (a preempted sequence is back there)
    RUNNING = "running"      # in every forward; holds a slot and its KV pages
    RELEASING = "releasing"  # (server) aborted while running: leaves at the next step
    FINISHED = "finished"    # done (finished, aborted or failed)


class Sequence:
    """Decoding state of one sample (plain data; the decoder mutates it)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, block_size: int, mask_id: int,
                 seq_id: int | None = None, noise_seed: int | None = None) -> None:
        """noise_seed: the noise key when the request has no seed (None: drawn from torch's global generator)."""
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.block_size = block_size
        self.mask_id = mask_id
        self.completion_ids: list[int] = []
        self.trace = Trace(prompt_len=len(prompt_ids), block_size=block_size,
                           logit_bias=dict(params.logit_bias) if params.logit_bias else None)
        self.error: str | None = None  # why the sequence failed (finish_reason "error")
        self.num_forwards = 0
        self.status = SeqStatus.NEW
        self.num_preemptions = 0  # times the scheduler took its pages back (it is then re-admitted, recomputed)
        self.slot: int | None = None  # the slot it was given at its last admission (kept once released)
        self.block_table: list[int] = []  # its KV pages while it runs (dllm.block_manager)
        self.num_cached_tokens = 0  # prefix positions whose K/V its shared pages held when admitted
        self.prefix_keys: tuple[int, list[bytes]] | None = None  # (version, keys of its complete prompt blocks)
        self.text = ""
        self.text_stream: TextStream | None = None
        self.pending: list[int] | None = None  # clean ids just before the block whose K/V are not cached yet
        # the key of this sequence's sampling noise: the request seed, else drawn from torch's generator
        self.seed = params.seed if params.seed is not None else (
            noise_seed if noise_seed is not None else _draw_seed())
        self.block_start = len(prompt_ids) // block_size * block_size
        self.block_done = False  # no mask left in the block: post-processed, then the next run moves on
        self._new_block()

    def _new_block(self) -> None:
        B, start = self.block_size, self.block_start
        self.block_ids = [self.mask_id] * B
        given = self.prompt_ids[start:start + B]  # prompt tail inside the first block
        self.block_ids[:len(given)] = given
        self.block_steps = [0] * B
        self.block_logprobs = [0.0] * B
        self.step_in_block = 0
        self.block_done = False
        self.schedule = transfer_schedule(B - len(given), self.params.steps or B)

    def start_blocks_at(self, origin: int) -> None:
        """Blocks start at absolute position `origin` (the prompt's length: full-attention LLaDA / Dream, whose
        official rollouts start the first block at the prompt's end) instead of a multiple of the block size;
        before the first forward. Recorded in the trace (`block_origin`)."""
        if self.step_in_block or self.completion_ids or not 0 <= len(self.prompt_ids) - origin < self.block_size:
            raise ValueError(f"start_blocks_at({origin}): only before decoding, within the prompt's last block")
        self.block_start = self.trace.block_origin = origin
        self._new_block()

    def next_block(self, owe_cache: bool = True) -> None:
        """Move on past a completed block (with a cache, its clean ids are owed to it: `pending`)."""
        self.pending = self.block_ids if owe_cache else None
        self.block_start += self.block_size
        self._new_block()

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the sequence ended (None while it runs): the trace's, stored once."""
        return self.trace.finish_reason

    @finish_reason.setter
    def finish_reason(self, reason: FinishReason | None) -> None:
        self.trace.finish_reason = reason

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def end_pos(self) -> int:
        return self.block_start + self.block_size

    def masked_positions(self) -> list[int]:
        return [i for i, t in enumerate(self.block_ids) if t == self.mask_id and self._is_gen(i)]

    def _is_gen(self, i: int) -> bool:
        return self.block_start + i >= len(self.prompt_ids)


@dataclass
class GenerationOutput:
    """A finished sample, as `dllm.decoding.generate` returns it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: str
    trace: Trace
    num_forwards: int
    error: str | None = None


def step_inputs(s: Sequence) -> list:
    """One sequence's inputs of a denoising step as one float64 row (the full-attention decoder's layout,
    dllm.full.runner, until it takes the typed step of dllm.step): block ids, steps, logprobs [3B],
    then dllm.step.FIELDS' values (step is 1-based, k from the schedule, write 1, the sampling
    parameters). The decoder adds the noise."""
    k = s.schedule[min(s.step_in_block, len(s.schedule) - 1)]
    return [*s.block_ids, *s.block_steps, *s.block_logprobs, s.block_start, s.step_in_block + 1, k,
            Strategy(s.params.strategy).code, float(s.params.threshold), s.slot or 0, 1.0, *param_row(s.params)]


def to_output(s: Sequence, tokenizer: PreTrainedTokenizerBase | None = None) -> GenerationOutput:
    assert s.finish_reason is not None, f"to_output: sequence {s.seq_id} is not finished"
    return GenerationOutput(s.prompt_ids, s.completion_ids, s.text, s.finish_reason, s.trace, s.num_forwards,
                            s.error)
