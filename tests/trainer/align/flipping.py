"""The tests' fake of `dlrl align`: a controller that trains chosen steps on flipped rewards.

    DLRL_TEST_FLIP_REWARD_STEPS=4,5,6 python -m tests.trainer.align.flipping align --config configs/align.yaml ...
    LocalAlign(config, overrides, align_module="tests.trainer.align.flipping")   # examples/align/local.py

Steps (1-based) in DLRL_TEST_FLIP_REWARD_STEPS train on 1 - reward (rewards in [0, 1]), with Adam's
moments reset at the first of a run of them: a deliberately bad candidate, which the gate must stop.
Every version pushed from the first flipped step until a revert is marked `flipped` in the registry
(`data.flipped`; `data.flipped_step` marks the flipped steps themselves), and so is the step's
metrics line (`flipped`), so a candidate that trained on them is recognisable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from trainer.align import cli
from trainer.align.controller import Aligner
from trainer.rl.rollouts import Batch

FLIP_ENV = "DLRL_TEST_FLIP_REWARD_STEPS"


def flip_steps() -> set[int]:
    return {int(s) for s in os.environ.get(FLIP_ENV, "").split(",") if s.strip()}


class FlippedReward:
    """`base`'s reward, 1 - r while `is_flipped()`."""

    def __init__(self, base: Callable[..., float], is_flipped: Callable[[], bool]) -> None:
        self.base, self.is_flipped = base, is_flipped
        self.name = getattr(base, "name", "reward")

    def __call__(self, text: str, example: dict, num_tokens: int | None = None) -> float:
        r = self.base(text, example) if num_tokens is None else self.base(text, example, num_tokens)
        return 1.0 - r if self.is_flipped() else r


class FlippingAligner(Aligner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flip = flip_steps()
        self.flipped = False  # trained on flipped rewards since the policy last was the serving weights
        self.run.reward_fn = FlippedReward(self.run.reward_fn, lambda: self.step_no + 1 in self.flip)

    def collect(self, run: Any, step: int) -> Batch:
        if step + 1 in self.flip and step not in self.flip:
            self.reset_optimizer()  # the flipped reward acts at once, not after Adam's momentum
        return super().collect(run, step)

    def pushing(self, run: Any, step: int) -> None:
        self.flipped |= step + 1 in self.flip

    def version_data(self, step: int) -> dict[str, Any]:
        return {"flipped": self.flipped, "flipped_step": step + 1 in self.flip}

    def stepped(self, run: Any, step: int, batch: Batch, parent: int) -> dict[str, Any]:
        return super().stepped(run, step, batch, parent) | {"flipped": int(step + 1 in self.flip)}

    def revert(self) -> None:
        canary = self.promo.canary
        to = canary.cand.version if canary is not None else self.promo.serving_version
        self.flipped = bool((self._row(to).get("data") or {}).get("flipped"))
        super().revert()

    def state_dict(self) -> dict:
        return super().state_dict() | {"flipped": self.flipped}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.flipped = bool(state.get("flipped", False))


def main(argv: list[str]) -> int:
    """`dlrl align` with the flipping controller (argv as `dlrl align`'s, after the word `align`)."""
    return cli.main(argv, aligner=FlippingAligner)


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[1:] if args[:1] == ["align"] else args))
