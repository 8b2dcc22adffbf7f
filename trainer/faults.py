"""Fault injection for crash tests: SIGKILL this trainer at a chosen point of a chosen step.

    DLRL_FAULT=push:3 dlrl train ...     # rank 0 kills itself in the middle of step 3's push

Points: `rollout` (while step N's rollout requests are in flight), `optimizer` (between a
backward and its optimizer step), `push` (after the first tensor of the push has been sent).
Unset (the default) every call is a no-op. Used by tests/test_trainer_crash.py to prove that
`--resume` after a real `kill -9` at each point loses no step, applies none twice, and leaves
the servers holding exactly the trainer's weights.
"""

from __future__ import annotations

import os
import signal
import threading

_step = 0


def set_step(step: int) -> None:
    """The 1-based step the run is in (rank-agnostic: only rank 0 crashes)."""
    global _step
    _step = step


def _wanted(point: str) -> bool:
    spec = os.environ.get("DLRL_FAULT", "")
    if not spec or os.environ.get("RANK", "0") != "0":
        return False
    name, _, step = spec.partition(":")
    return name == point and step.isdigit() and int(step) == _step


def crash_at(point: str, delay_s: float = 0.0) -> None:
    """SIGKILL this process now (or after `delay_s`, from a thread) if DLRL_FAULT names this point."""
    if not _wanted(point):
        return
    if delay_s > 0:
        threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        os.kill(os.getpid(), signal.SIGKILL)
