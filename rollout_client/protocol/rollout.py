"""`Rollout`: one generated sample as the trainer sees it, built by `RolloutClient` from a `Sample`.

    rollout = Rollout.from_sample(sample, start=8, n=4, server="http://127.0.0.1:8000")
    rollout.prompt_index, rollout.completion_ids, rollout.trace.global_steps(), rollout.logprobs
"""

from __future__ import annotations

from rollout_client.protocol.native import Sample
from rollout_client.protocol.sample import Generated


class Rollout(Generated):
    """One generated sample as the trainer sees it (built by `RolloutClient` from a `Sample`).
    It is also the replay input: prompt_ids, completion_ids and the trace (steps, behaviour
    logprobs, tail) are all that trace replay needs."""

    prompt_index: int
    sample_index: int
    server: str = ""

    @property
    def logprobs(self) -> list[float]:
        """Behaviour logprob per completion token (the trace's)."""
        return list(self.trace.logprobs) if self.trace is not None else []

    @classmethod
    def from_sample(cls, s: Sample, start: int, n: int, server: str) -> Rollout:
        """The rollout of sample `s` of a request whose first prompt has global index `start`."""
        return cls.copy_from(s, prompt_index=start + s.prompt_index, sample_index=s.index % n, server=server)
