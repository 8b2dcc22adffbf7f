"""`Rollout`: one generated sample as the trainer sees it, built by `RolloutClient` from a `Sample`.

    rollout = Rollout.from_sample(sample, start=8, n=4, server="http://127.0.0.1:8000")
    rollout.prompt_index, rollout.completion_ids, rollout.trace.global_steps(), rollout.logprobs
"""

from __future__ import annotations

from pydantic import BaseModel

from dllm.trace import Trace
from rollout_client.protocol.common import FinishReason
from rollout_client.protocol.native import Sample


class Rollout(BaseModel):
    """One generated sample as the trainer sees it (built by `RolloutClient` from a `Sample`).
    It is also the replay input: prompt_ids, completion_ids and the trace (steps, behaviour
    logprobs, tail) are all that trace replay needs."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: FinishReason
    version: int
    trace: Trace | None = None
    server: str = ""
    record_id: str | None = None

    @property
    def logprobs(self) -> list[float]:
        """Behaviour logprob per completion token (the trace's)."""
        return list(self.trace.logprobs) if self.trace is not None else []

    @classmethod
    def from_sample(cls, s: Sample, start: int, n: int, server: str) -> Rollout:
        """The rollout of sample `s` of a request whose first prompt has global index `start`."""
        return cls(prompt_index=start + s.prompt_index, sample_index=s.index % n, prompt_ids=s.prompt_ids,
                   completion_ids=s.completion_ids, text=s.text, finish_reason=s.finish_reason,
                   version=s.version, trace=s.trace, server=server, record_id=s.record_id)
