"""`dlrl train nproc=N`: start N local trainer ranks with torchrun and wait for them.

    dlrl train --config configs/tiny.yaml nproc=2          # = torchrun --standalone --nproc_per_node 2 \
                                                           #       -m dlrl.cli train --config configs/tiny.yaml

Under a launcher (torchrun, the DeepSpeed launcher, a Kubernetes indexed Job or Slurm setting
RANK / WORLD_SIZE) `nproc` is not used: the launcher already started the ranks. The local
launch is torch's own elastic agent (`torch.distributed.run`): a rank that fails stops the
others; SIGTERM / SIGINT are forwarded to the ranks, which checkpoint and exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("dlrl.train")


def under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run `dlrl train <argv>` as `nproc` local ranks; returns the job's exit code."""
    argv = [a for a in argv if not a.split("=", 1)[0].removeprefix("train.") == "nproc"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dlrl.cli", "train", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log.info("starting %d local ranks: %s", nproc, " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
