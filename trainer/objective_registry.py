"""The registry of `train.objective` (torch-free: trainer.config builds its choices from it without
importing torch; trainer/rl/objectives.py registers the built-in losses on import).

    @register_objective("mine")                 # before trainer.config is imported
    def loss(cfg, new_lp, old_lp, adv, mask, ref_lp, entropy, weights): ...   -> (loss, metrics)
    OBJECTIVES["dipo"].loss                      # after `import trainer.rl.objectives`
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUILTIN = ("tracerl", "dipo", "random_masking", "coupled")  # trainer/rl/objectives.py, in train.objective's help order


@dataclass(frozen=True)
class ObjectiveSpec:
    """One `train.objective`: its loss from the train config, and `masks` for the masked-diffusion
    baselines (valid [B,L] -> (masks, ts): the rows are fresh random masks with 1/t ELBO weights,
    `trainer.rl.learner.baseline_rows`); None: the rows are the replayed trace steps."""

    name: str
    loss: Callable[..., Any]  # trainer.rl.objectives.LossFn
    masks: Callable[..., Any] | None = None  # trainer.rl.objectives.MaskFn


OBJECTIVES: dict[str, ObjectiveSpec] = {}


def register_objective(name: str, masks: Callable[..., Any] | None = None) -> Callable[[Callable[..., Any]],
                                                                                       Callable[..., Any]]:
    """Decorator: `@register_objective("name")` over `loss(cfg, new_lp, old_lp, adv, mask, ref_lp,
    entropy, weights) -> (loss, metrics)` makes `train.objective=name` valid (register before
    trainer.config is imported: its choices are the names registered then)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        OBJECTIVES[name] = ObjectiveSpec(name, fn, masks)
        return fn

    return deco


def objective_names() -> tuple[str, ...]:
    """The built-in names (registered by trainer.rl.objectives), then the others registered."""
    return BUILTIN + tuple(n for n in OBJECTIVES if n not in BUILTIN)
