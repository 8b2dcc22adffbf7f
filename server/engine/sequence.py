"""The server-side state of one sequence, owned by the scheduler (server/engine/scheduler.py).

    seq = runner.new_sequence(prompt_ids, params)   # a ServerSequence, status NEW (validated)
    seq.deadline, seq.deadline_status = t, 408      # server.api.generation: before it is submitted
    seq.status                                      # SeqStatus: only Scheduler methods change it
    seq.arrived_at, seq.admitted_at, seq.first_token_at, seq.finished_at   # time.monotonic() stamps

`ServerSequence` is `dllm.sequence.Sequence` (the decoding state the runner advances: block,
completion, trace, `finish_reason` stored once in the trace) with the server's fields declared:
its status and timings, its deadline, the KV slot and pages the scheduler accounts for, the
top logprobs it asked for and got, and the recorder's decision. Status moves only forward:

    NEW -> WAITING -> RUNNING -> (RELEASING ->) FINISHED      (WAITING -> FINISHED: aborted in the queue)
"""

from __future__ import annotations

from enum import StrEnum

from dllm.sampling import SamplingParams
from dllm.sequence import Sequence


class SeqStatus(StrEnum):
    NEW = "new"              # made and validated, not submitted yet
    WAITING = "waiting"      # in the scheduler's queue
    RUNNING = "running"      # in every forward; holds a slot and its KV pages
    RELEASING = "releasing"  # aborted while running (client gone, deadline, pause): leaves at the next step
    FINISHED = "finished"    # done (finished, aborted or failed); its request has heard of it


class ServerSequence(Sequence):
    """A sequence as the server schedules it (declared fields only; see the module docstring)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, block_size: int, mask_id: int,
                 seq_id: int | None = None):
        super().__init__(prompt_ids, params, block_size, mask_id, seq_id)
        self.status = SeqStatus.NEW
        self.arrived_at: float | None = None      # submitted (Engine.submit)
        self.admitted_at: float | None = None     # waiting -> running
        self.first_token_at: float | None = None  # its first block committed
        self.finished_at: float | None = None     # -> finished
        self.deadline: float | None = None        # time.monotonic() by which its request must end
        self.deadline_status = 0                  # the HTTP status past it (408 the client's, 503 the server's)
        self.num_pages = 0                        # KV pages the scheduler gave it (prompt + max_tokens)
        self.num_top_logprobs = 0                 # top logprobs asked for (OpenAI logprobs); 0 = none
        self.top_logprobs: list[list[tuple[int, float]]] | None = None  # per completion token, once finished
        self.recording: object = None             # server.recording.recording's decision for it (None: not decided)
