"""Which train options apply to full-attention models (LLaDA / Dream): every built-in objective and the value
model do; the objectives' registry and `check_family` refuse the others by key, with no torch model built."""

from __future__ import annotations

import pytest

import trainer.rl.objectives  # noqa: F401  (registers the built-in objectives)
from trainer.config import TrainConfig
from trainer.objective_registry import OBJECTIVES, check_family, register_objective


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
@pytest.mark.parametrize("objective", ["tracerl", "dipo", "random_masking", "coupled"])
def test_every_builtin_objective_applies_to_every_family(objective: str, family: str) -> None:
    check_family(TrainConfig(objective=objective), family)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_value_model_applies_to_every_family(family: str) -> None:
    for objective in ("tracerl", "dipo"):  # TraceRL's value model + step-wise GAE: bidirectional for LLaDA / Dream
        check_family(TrainConfig(objective=objective, use_value_model=True), family)


def test_an_objective_registered_for_some_families_is_refused_for_the_others() -> None:
    @register_objective("test_sdar_only_objective", families=("sdar",))
    def _loss(*args: object) -> None:
        return None

    try:
        cfg = TrainConfig.model_construct(objective="test_sdar_only_objective", use_value_model=False)
        check_family(cfg, "sdar")
        with pytest.raises(ValueError, match=r"^train\.objective: 'test_sdar_only_objective' applies to sdar"):
            check_family(cfg, "llada")
    finally:
        del OBJECTIVES["test_sdar_only_objective"]
