"""The registry of `train.objective` (torch-free: trainer.config builds its choices from it without
importing torch; trainer/rl/objectives.py registers the built-in losses on import).

    @register_objective("mine")                 # before trainer.config is imported
    def loss(cfg, new_lp, old_lp, adv, mask, ref_lp, entropy, weights): ...   -> (loss, metrics)
    OBJECTIVES["dipo"].loss                      # after `import trainer.rl.objectives`
    check_family(cfg, "llada")                   # ValueError naming the key when a choice does not apply

Model families (dllm's `family` of the loaded config): `sdar` (block-causal SDAR / TraDo) and the
full-attention `llada` / `dream`. Every built-in objective applies to both kinds (TraceRL / DiPO replay
the trace's steps with the family's own rows; the random-masking / coupled baselines draw their masks
over the completion), and so does the diffusion value model with step-wise GAE (`train.use_value_model`:
trainer.rl.value_model builds the family's backbone, bidirectional for LLaDA / Dream, over the same rows).
An objective registered with `families=(...)` is refused for the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUILTIN = ("tracerl", "dipo", "random_masking", "coupled")  # trainer/rl/objectives.py, in train.objective's help order
FULL_ATTENTION_FAMILIES = ("llada", "dream")  # bidirectional attention over the whole sequence


@dataclass(frozen=True)
class ObjectiveSpec:
    """One `train.objective`: its loss from the train config, and `masks` for the masked-diffusion
    baselines (valid [B,L] -> (masks, ts): the rows are fresh random masks with 1/t ELBO weights,
    `trainer.rl.learner.baseline_rows`); None: the rows are the replayed trace steps."""

    name: str
    loss: Callable[..., Any]  # trainer.rl.objectives.LossFn
    masks: Callable[..., Any] | None = None  # trainer.rl.objectives.MaskFn
    families: tuple[str, ...] | None = None  # model families it applies to (None: all)


OBJECTIVES: dict[str, ObjectiveSpec] = {}


def register_objective(name: str, masks: Callable[..., Any] | None = None,
                       families: tuple[str, ...] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `@register_objective("name")` over `loss(cfg, new_lp, old_lp, adv, mask, ref_lp,
    entropy, weights) -> (loss, metrics)` makes `train.objective=name` valid (register before
    trainer.config is imported: its choices are the names registered then). `families`: the model
    families it applies to (None: all; `check_family` refuses the others)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        OBJECTIVES[name] = ObjectiveSpec(name, fn, masks, families)
        return fn

    return deco


def objective_names() -> tuple[str, ...]:
    """The built-in names (registered by trainer.rl.objectives), then the others registered."""
    return BUILTIN + tuple(n for n in OBJECTIVES if n not in BUILTIN)


def check_family(cfg: Any, family: str) -> None:
    """Refuse the train config's choices that do not apply to a model of `family` (ValueError naming the key)."""
    spec = OBJECTIVES.get(cfg.objective)
    if spec is not None and spec.families is not None and family not in spec.families:
        raise ValueError(f"train.objective: {cfg.objective!r} applies to {', '.join(spec.families)} models, "
                         f"not to this {family} model")
