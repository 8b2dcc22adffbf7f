"""Checkpointer: collective save / resume of a run (policy engine, value engine, run state).

    ckpt = Checkpointer(out_dir / "checkpoint", ranks, policy_engine, value_engine, zero_stage=2)
    ckpt.save(step, {"step": 7, "version": 7, "sampler": {...}, "seed": 9})   # every rank calls it
    state = ckpt.load()                                                       # every rank calls it

Layout: `checkpoint/step<N>/` (DeepSpeed policy state, `client_state.json` from rank 0,
`rng_rank<r>.json` per rank), `checkpoint/value/step<N>/` for the value model, `latest` files
naming the newest complete tag. The client state records the world size and ZeRO stage: a
ZeRO-1/2/3 checkpoint holds one optimizer shard per rank, so resuming it with another number
of ranks stops with an error that says so; ZeRO-0 (whole optimizer state on rank 0) resumes
with any number of ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainer.infra.dist import Ranks
from trainer.infra.ds_engine import has_checkpoint, load_checkpoint, read_client_state, save_checkpoint

log = logging.getLogger("dlrl.train")


class Checkpointer:
    def __init__(self, root: Path, ranks: Ranks, engine: Any, value_engine: Any = None, *, zero_stage: int = 0,
                 keep_last: int = 2):
        self.root, self.ranks, self.engine, self.value_engine = Path(root), ranks, engine, value_engine
        self.zero_stage, self.keep_last = zero_stage, keep_last

    def exists(self) -> bool:
        return has_checkpoint(self.root)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Collective: every rank writes its part; `latest` moves once all is written."""
        state = {**state, "step": step, "world_size": self.ranks.world_size, "zero_stage": self.zero_stage}
        if self.value_engine is not None:
            save_checkpoint(self.value_engine, self.root / "value", {"step": step}, keep_last=self.keep_last)
        save_checkpoint(self.engine, self.root, state, keep_last=self.keep_last)
        self.ranks.barrier()
        if self.ranks.is_main:
            log.info("checkpoint at step %d -> %s", step, self.root)

    def load(self) -> dict[str, Any]:
        """Collective: restore engines and RNG; returns the run state saved with them."""
        if not self.exists():
            raise RuntimeError(f"resume: no checkpoint in {self.root}")
        saved = read_client_state(self.root)
        n, stage = int(saved.get("world_size", 1)), int(saved.get("zero_stage", self.zero_stage))
        if stage != self.zero_stage:
            raise RuntimeError(f"resume: the checkpoint in {self.root} was written with ZeRO-{stage}; "
                               f"this run uses train.zero_stage={self.zero_stage}")
        if n != self.ranks.world_size and stage > 0:
            raise RuntimeError(f"resume: the checkpoint in {self.root} was written by {n} rank(s) with ZeRO-{stage} "
                               f"(one optimizer shard per rank); resume it with nproc={n}, not "
                               f"{self.ranks.world_size}")
        state = load_checkpoint(self.engine, self.root, restore_rng=n == self.ranks.world_size)
        if self.value_engine is not None:
            load_checkpoint(self.value_engine, self.root / "value", restore_rng=False)
        return state
