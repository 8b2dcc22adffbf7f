"""Refusals before a run touches anything that is not its own.

    previous_run(Path("runs/tiny-rl"))        -> ["metrics.jsonl", "final"]: an earlier run is there
    clear_previous_run(out)                   train.overwrite=true: remove what dlrl wrote there
    check_served_model(fleet, cfg, "tiny-sft") -> servers serving another model (error unless
                                                 train.take_over_servers=true; then renamed)
    resume_state(cfg)                         -> ResumeState: what --resume would continue, or why it cannot
                                                 (read from output_dir/checkpoint's JSON alone: no torch)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.infra.fleet import ServerFleet

log = logging.getLogger("dlrl.train")


PREVIOUS_RUN = ("metrics.jsonl", "checkpoint", "final", "curves.png")  # what marks a run that trained
RUN_FILES = (*PREVIOUS_RUN, "versions.jsonl", "tb", "run_id")


def previous_run(out: Path, names: tuple[str, ...] = PREVIOUS_RUN) -> list[str]:
    """What of an earlier run `out` holds (empty: a fresh folder)."""
    return [name for name in names if (out / name).exists()]


def clear_previous_run(out: Path) -> None:
    """train.overwrite=true: remove an earlier run's outputs (only those dlrl writes)."""
    for name in previous_run(out, RUN_FILES):
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    log.warning("train.overwrite=true: removed the previous run in %s", out)


def check_served_model(fleet: ServerFleet, cfg: TrainConfig, name: str) -> list[str]:
    """The servers that serve another model than `name` (rank 0). An error unless
    train.take_over_servers=true; then a warning, and they are renamed after the first push."""
    others = {u: n for u, n in fleet.names().items() if n is not None and n != name}
    if not others:
        return []
    held = ", ".join(f"{u} serves {n!r}" for u, n in others.items())
    if not cfg.take_over_servers:
        from trainer.infra.fleet import FleetError  # (weight_sync, torch) only when it is raised

        raise FleetError(f"{held}, not the model being trained ({name!r}, train.model={cfg.model or '<default>'}): "
                         "refusing to overwrite its weights. Point train.servers at servers of this model, or "
                         "set train.take_over_servers=true to train them anyway (they are renamed to "
                         f"{name!r})")
    log.warning("train.take_over_servers=true: %s; overwriting their weights with %r and renaming them", held, name)
    return list(others)


CHECKPOINT = "checkpoint"  # output_dir/checkpoint: `latest` names the newest complete step folder (ds_engine)


@dataclass(frozen=True)
class ResumeState:
    """What `--resume` finds in output_dir: `step` of the newest checkpoint (None: none), and `problem`
    ("" when --resume can continue it; else what is wrong and what to do instead)."""

    step: int | None
    version: int | None
    problem: str

    def summary(self) -> str:
        if self.step is None:
            return "no checkpoint"
        return f"checkpoint at step {self.step} (weight version {self.version})"


def read_checkpoint(out: Path) -> dict[str, Any] | None:
    """The run state of output_dir's newest checkpoint (step, version, world_size, zero_stage, ...), None
    when there is none (or it is unreadable)."""
    root = out / CHECKPOINT
    try:
        tag = (root / "latest").read_text().strip()
        state = json.loads((root / tag / "client_state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def resume_state(cfg: Any) -> ResumeState:
    """Whether `dlrl train --resume` can continue output_dir, checked before anything starts (torch-free)."""
    out = Path(cfg.output_dir)
    state = read_checkpoint(out)
    if state is None:
        every = (f"train.checkpoint_every={cfg.checkpoint_every} saves one every {cfg.checkpoint_every} steps"
                 if cfg.checkpoint_every else "train.checkpoint_every=0 saves one only when a run is stopped by "
                 "SIGTERM / Ctrl-C")
        found = previous_run(out)
        what = f"it holds a previous run ({', '.join(found)}) but no checkpoint" if found else "it holds no run"
        instead = ("start over with overwrite=true" if found else "start the run without --resume") + \
            " (checkpoint_every=N makes a run resumable after a crash)"
        return ResumeState(None, None, f"--resume: nothing to continue in train.output_dir={out}: {what} ({every}); "
                           + instead)
    step, version = int(state.get("step", 0)), int(state.get("version", 0))
    n, stage = int(state.get("world_size", 1)), int(state.get("zero_stage", 0))
    problem = ""
    if step >= cfg.num_steps:
        problem = (f"--resume: the run in {out} is complete (checkpoint at step {step}, train.num_steps="
                   f"{cfg.num_steps}): raise num_steps to train it further (--resume num_steps={step + cfg.num_steps}),"
                   " or start over with overwrite=true")
    elif stage != cfg.zero_stage:
        problem = (f"--resume: the checkpoint in {out / CHECKPOINT} was written with ZeRO-{stage}; this run uses "
                   f"train.zero_stage={cfg.zero_stage} (set zero_stage={stage})")
    elif stage > 0 and n != (world := int(os.environ.get("WORLD_SIZE") or cfg.nproc)):
        problem = (f"--resume: the checkpoint in {out / CHECKPOINT} was written by {n} rank(s) with ZeRO-{stage} "
                   f"(one optimizer shard per rank); resume it with nproc={n}, not {world}")
    return ResumeState(step, version, problem)


def previous_run_refusal(cfg: Any) -> str:
    """An error when output_dir holds an earlier run and neither --resume nor overwrite=true was given; it
    recommends --resume only when there is a checkpoint that --resume can continue."""
    out = Path(cfg.output_dir)
    found = previous_run(out)
    if not found or cfg.resume or cfg.overwrite:
        return ""
    head = f"train.output_dir={out} holds a previous run ({', '.join(found)}): "
    state = resume_state(cfg)
    if state.step is not None and not state.problem:
        return head + (f"continue it from step {state.step} with --resume, replace it with overwrite=true, or "
                       "choose another output_dir=...")
    why = (f" ({state.problem.removeprefix('--resume: ')})" if state.step is not None else
           " (it has no checkpoint to --resume: train.checkpoint_every=N makes a run resumable)")
    return head + f"replace it with overwrite=true, or choose another output_dir=...{why}"
