"""trainer.infra.faults.Faults, the run's fault hook: fires a real SIGKILL only at its point and step, on rank 0.

    .venv/bin/python -m pytest -q tests/trainer/test_trainer_faults.py

(tests/trainer/test_trainer_crash.py drives it end to end through DLRL_FAULT and `dlrl train --resume`.)
"""

import signal
import subprocess
import sys

import pytest

from trainer.infra.faults import Faults

SCRIPT = """
import os, sys, time
from trainer.infra.faults import Faults
faults = Faults.from_env()
for step in (1, 2, 3):
    faults.set_step(step)
    for point in ("rollout", "optimizer", "push"):
        print(step, point, flush=True)
        faults.crash_at(point, delay_s=float(sys.argv[1]))
        time.sleep(0.3 if float(sys.argv[1]) else 0)
"""


def _run(env: dict, delay: float = 0.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(delay)], env={"PATH": "/usr/bin", **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_the_named_point_of_the_named_step_is_killed(delay):
    p = _run({"DLRL_FAULT": "optimizer:2"}, delay)
    assert p.returncode == -signal.SIGKILL
    assert p.stdout.split("\n")[-2] == "2 optimizer"  # nothing after the point ran


@pytest.mark.parametrize("env", [{}, {"DLRL_FAULT": "optimizer:2", "RANK": "1"}, {"DLRL_FAULT": "optimizer"},
                                 {"DLRL_FAULT": "push:9"}])
def test_unset_other_ranks_malformed_or_never_reached_specs_do_nothing(env):
    p = _run(env)
    assert p.returncode == 0 and p.stdout.split("\n")[-2] == "3 push"


def test_the_default_hook_is_a_no_op():
    f = Faults()
    f.set_step(1)
    f.crash_at("rollout")
    assert f.point is None and Faults.from_env({"DLRL_FAULT": "push:3"}).point == "push"


DURING = """
import sys, time
from trainer.infra.faults import Faults
faults = Faults.from_env()
faults.set_step(2)
try:
    with faults.during("rollout", delay_s=0.2):
        print("in", flush=True)
        if sys.argv[1] == "raise":
            raise RuntimeError("rollouts failed")
        time.sleep(float(sys.argv[1]))  # a block shorter or longer than the delay
        print("block done", flush=True)
except RuntimeError:
    print("handled", flush=True)
print("after", flush=True)
"""


@pytest.mark.parametrize(("block_s", "last"), [("0", "block done"), ("5", "in"), ("raise", "in")])
def test_during_dies_inside_the_block_even_when_the_block_beats_the_timer(block_s, last):
    p = subprocess.run([sys.executable, "-c", DURING, block_s], env={"PATH": "/usr/bin", "DLRL_FAULT": "rollout:2"},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert p.stdout.split("\n")[-2] == last  # nothing after the block ran (a slow block: killed by the timer;
    # a block that raised: killed before its handler)
