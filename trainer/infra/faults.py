"""Fault injection for crash tests: SIGKILL this trainer at a chosen point of a chosen step.

    DLRL_FAULT=push:3 dlrl train ...     # rank 0 kills itself in the middle of step 3's push

    faults = Faults.from_env()           # build_run: run.faults, handed to the learner and the publisher
    faults.set_step(step + 1)            # the loop, at the start of each step
    faults.crash_at("push")              # a no-op unless DLRL_FAULT names this point and step
    with faults.during("rollout", 0.05):  # dies after 0.05 s inside the block, or at its end at the latest
        ...

Points: `rollout` (while step N's rollout requests are in flight, or as they return at the
latest), `optimizer` (between a backward and its optimizer step), `push` (after the first tensor
of the push has been sent).
Unset (the default, and `Faults()`) every call is a no-op. Used by tests/trainer/test_trainer_crash.py
to prove that `--resume` after a real `kill -9` at each point loses no step, applies none twice,
and leaves the servers holding exactly the trainer's weights.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class Faults:
    """The fault hook of one run: `spec` is DLRL_FAULT (`point:step`), `rank` this process's RANK
    (only rank 0 crashes). An empty or malformed spec never fires."""

    def __init__(self, spec: str = "", rank: str = "0"):
        point, _, step = spec.partition(":")
        armed = bool(spec) and rank == "0" and step.isdigit()
        self.point: str | None = point if armed else None
        self.at_step = int(step) if armed else -1
        self.step = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Faults:
        return cls(environ.get("DLRL_FAULT", ""), environ.get("RANK", "0"))

    def set_step(self, step: int) -> None:
        """The 1-based step the run is in (rank-agnostic: only rank 0 crashes)."""
        self.step = step

    def crash_at(self, point: str, delay_s: float = 0.0) -> None:
        """SIGKILL this process now (or after `delay_s`, from a thread) if the spec names this point."""
        if point != self.point or self.step != self.at_step:
            return
        if delay_s > 0:
            threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    @contextmanager
    def during(self, point: str, delay_s: float) -> Iterator[None]:
        """SIGKILL this process inside the block if the spec names this point: after `delay_s`
        (from a timer, so it lands while the block's work is in flight), and at the block's end at
        the latest. A timer alone is a race: on a loaded machine the block can finish first, and
        the crash would land in a later phase of the step."""
        self.crash_at(point, delay_s)
        try:
            yield
        finally:  # a block that raised (rollouts failed) dies here too, not in a later phase
            self.crash_at(point)
