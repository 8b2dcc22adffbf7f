"""The server-side state of one sequence, owned by the scheduler (server/engine/scheduler.py).

    seq = runner.new_sequence(prompt_ids, params)   # a ServerSequence, status NEW (validated)
    seq.deadline, seq.deadline_status = t, 408      # server.api.generation: before it is submitted
    seq.status                                      # SeqStatus: only Scheduler methods change it
    seq.arrived_at, seq.admitted_at, seq.first_token_at, seq.finished_at   # time.monotonic() stamps

`ServerSequence` is `dllm.sequence.Sequence` (the decoding state the runner advances: block,
completion, trace, `finish_reason` stored once in the trace; its status, slot and KV pages, which
the scheduler and its block manager write) with the server's fields declared: its timings, its
deadline, the top logprobs it asked for and got, and the recorder's decision. Status moves only
forward (RUNNING -> WAITING: preempted, server.kv_admission=optimistic):

    NEW -> WAITING -> RUNNING -> (RELEASING ->) FINISHED      (WAITING -> FINISHED: aborted in the queue)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from dllm.sampling_params import SamplingParams
from dllm.sequence import SeqStatus, Sequence

__all__ = ["SeqStatus", "ServerSequence", "samples"]


def samples(prompts_ids: list[list[int]], params: SamplingParams,
            n: int) -> Iterator[tuple[list[int], SamplingParams]]:
    """(prompt ids, params) of each of the `n` samples of each prompt, prompt-major: sample i of a prompt uses
    seed + i when seeded (Engine.make_sequences and its API-process mirror, CoreClient.make_sequences)."""
    for ids in prompts_ids:
        for i in range(n):
            yield ids, params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)


class ServerSequence(Sequence):
    """A sequence as the server schedules it (declared fields only; see the module docstring)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, block_size: int, mask_id: int,
                 seq_id: int | None = None, noise_seed: int | None = None):
        super().__init__(prompt_ids, params, block_size, mask_id, seq_id, noise_seed)
        self.arrived_at: float | None = None      # submitted (Engine.submit)
        self.admitted_at: float | None = None     # waiting -> running (the first time)
        self.first_token_at: float | None = None  # its first block committed
        self.finished_at: float | None = None     # -> finished
        self.deadline: float | None = None        # time.monotonic() by which its request must end
        self.deadline_status = 0                  # the HTTP status past it (408 the client's, 503 the server's)
        self.num_top_logprobs = 0                 # top logprobs asked for (OpenAI logprobs); 0 = none
        self.top_logprobs: list[list[tuple[int, float]]] | None = None  # per completion token, once finished
        self.recording: object = None             # server.recording.recording's decision for it (None: not decided)
