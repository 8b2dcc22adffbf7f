"""Refusals before a run touches anything that is not its own.

    previous_run(Path("runs/tiny-rl"))        -> ["metrics.jsonl", "final"]: an earlier run is there
    clear_previous_run(out)                   train.overwrite=true: remove what dlrl wrote there
    check_served_model(fleet, cfg, "tiny-sft") -> servers serving another model (error unless
                                                 train.take_over_servers=true; then renamed)
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from trainer.infra.fleet import FleetError

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


def check_served_model(fleet, cfg, name: str) -> list[str]:
    """The servers that serve another model than `name` (rank 0). An error unless
    train.take_over_servers=true; then a warning, and they are renamed after the first push."""
    others = {u: n for u, n in fleet.names().items() if n is not None and n != name}
    if not others:
        return []
    held = ", ".join(f"{u} serves {n!r}" for u, n in others.items())
    if not cfg.take_over_servers:
        raise FleetError(f"{held}, not the model being trained ({name!r}, train.model={cfg.model or '<default>'}): "
                         "refusing to overwrite its weights. Point train.servers at servers of this model, or "
                         "set train.take_over_servers=true to train them anyway (they are renamed to "
                         f"{name!r})")
    log.warning("train.take_over_servers=true: %s; overwriting their weights with %r and renaming them", held, name)
    return list(others)
