"""Rollout collection for the trainer: prompts -> server samples -> replay samples.

`RolloutSource.get(step)` returns the rollouts for a step. In `sync` mode it generates
them now; in `overlap` mode the rollouts of step k+1 are generated in a background
thread while step k trains (one-step off-policy: staleness is measured from the policy
version each sample reports and bounded by `max_staleness`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass

from rollout_client import RolloutClient
from trainer.replay import ReplaySample

log = logging.getLogger("dlrl.train")


@dataclass
class Batch:
    examples: list[dict]  # one per prompt
    rollouts: list  # rollout_client.protocol.Rollout, group_size per prompt, ordered
    seconds: float

    def samples(self) -> list[ReplaySample]:
        return [ReplaySample(r.prompt_ids, r.completion_ids, r.trace.steps, r.trace.tail_ids,
                             r.trace.tail_steps) for r in self.rollouts]


def sampling_kwargs(cfg, greedy: bool = False) -> dict:
    kw = {"max_tokens": cfg.max_tokens, "strategy": cfg.strategy, "threshold": cfg.threshold,
          "temperature": 0.0 if greedy else cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
    if cfg.denoise_steps:
        kw["steps"] = cfg.denoise_steps
    return kw


def fetch(servers: list[str], prompts: list, n: int, **kw) -> list:
    async def run():
        async with RolloutClient(servers, timeout=600.0, max_retries=5) as client:
            return await client.generate(prompts, n=n, return_trace=True, **kw)
    return asyncio.run(run())


class RolloutSource:
    def __init__(self, cfg, sampler, prompt_of):
        self.cfg, self.sampler, self.prompt_of = cfg, sampler, prompt_of
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        self.pending: concurrent.futures.Future | None = None
        self.seed = cfg.seed

    def _collect(self) -> Batch:
        examples = self.sampler.next_batch()
        t0 = time.perf_counter()
        self.seed += 1
        rollouts = fetch(self.cfg.servers, [self.prompt_of(e) for e in examples], self.cfg.group_size,
                         seed=self.seed * 100_003 % (2**31), **sampling_kwargs(self.cfg))
        return Batch(examples, rollouts, time.perf_counter() - t0)

    def get(self, policy_version: int) -> Batch:
        if self.pending is None:
            batch = self._collect()
        else:
            batch = self.pending.result()
            self.pending = None
            stale = policy_version - min(r.version for r in batch.rollouts)
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
