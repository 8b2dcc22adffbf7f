"""Rollout collection: the step's prompts -> this rank's shard of server samples.

    source = RolloutSource(cfg, ranks, fleet, sampler, prompt_ids_of)
    batch = source.get(policy_version)      # Batch: this rank's examples and rollouts
    source.close()

Every rank draws the same global batch of `prompts_per_step` prompts (same seeded sampler),
takes its contiguous shard of whole prompts (a group's `group_size` samples stay together:
group advantages and DAPO filtering need complete groups) and asks the servers for it
itself: N ranks fetch in parallel, the servers batch their requests together, and nothing
is scattered between ranks. In `sync` mode rollouts are generated when asked; in `overlap`
mode the next step's rollouts are generated in a background thread while this step trains
(one-step off-policy; staleness measured from each sample's policy version, bounded by
`max_staleness`, decided globally so every rank's sampler stays in step).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_client.protocol.rollout import Rollout
from trainer.infra.dist import Ranks

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.data.prompts import Sampler
    from trainer.infra.fleet import ServerFleet

log = logging.getLogger("dlrl.train")


@dataclass
class Batch:
    examples: list[dict]  # this rank's prompts (whole groups)
    rollouts: list[Rollout]  # group_size per prompt, prompt-major
    first_sample: int  # global index of this rank's first sample in the step
    num_samples: int  # samples in the whole step (all ranks)
    seconds: float

    def group_examples(self, group_size: int) -> list[dict]:
        """The example of every rollout (prompt-major, `group_size` each)."""
        return [e for e in self.examples for _ in range(group_size)]


def sampling_kwargs(cfg: TrainConfig, greedy: bool = False) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_tokens": cfg.max_tokens, "strategy": cfg.strategy, "threshold": cfg.threshold,
          "temperature": 0.0 if greedy else cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
    if cfg.denoise_steps:
        kw["steps"] = cfg.denoise_steps
    if cfg.stop:
        kw["stop"] = list(cfg.stop)
    if cfg.stop_token_ids:
        kw["stop_token_ids"] = list(cfg.stop_token_ids)
    return kw


class RolloutSource:
    def __init__(self, cfg: TrainConfig, ranks: Ranks, fleet: ServerFleet, sampler: Sampler, prompt_of: Callable[[dict], list[int]], seed: int) -> None:
        self.cfg, self.ranks, self.fleet, self.sampler, self.prompt_of = cfg, ranks, fleet, sampler, prompt_of
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        self.pending: concurrent.futures.Future | None = None
        self.seed = seed  # advanced once per collected batch (saved in checkpoints)

    def _collect(self) -> Batch:
        examples = self.sampler.next_batch()  # the global batch: identical on every rank
        shard = self.ranks.shard(len(examples))
        mine = examples[shard]
        t0 = time.perf_counter()
        self.seed += 1
        G = self.cfg.group_size
        rollouts = []
        if mine:  # one seed per step: sample i of every prompt uses seed + i, whoever fetches it
            rollouts = self.fleet.generate([self.prompt_of(e) for e in mine], G,
                                           seed=self.seed * 100_003 % (2**31), **sampling_kwargs(self.cfg))
        return Batch(mine, rollouts, shard.start * G, len(examples) * G, time.perf_counter() - t0)

    def get(self, policy_version: int) -> Batch:
        if self.pending is None:
            batch = self._collect()
        else:
            batch = self.pending.result()
            self.pending = None
            oldest = min((r.version for r in batch.rollouts), default=policy_version)
            (stale,) = self.ranks.max([policy_version - oldest])  # one decision for all ranks
            if stale > self.cfg.max_staleness:
                log.warning("dropping rollouts %d versions stale (max_staleness=%d)", stale,
                            self.cfg.max_staleness)
                batch = self._collect()
        if self.cfg.mode == "overlap":
            self.pending = self.pool.submit(self._collect)
        return batch

    def close(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
