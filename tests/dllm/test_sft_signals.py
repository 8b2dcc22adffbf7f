"""Signals during the first-start SFT of the embedded default (issue 37), with real signals to
real processes: one SIGTERM to `dlrl serve` stops the SFT at the end of its step, removes its
temporary folder and exits 0 with one line; SIGTERM then SIGINT to `dlrl train` stop it at once,
also cleanly: no traceback, no `.tmp` folder left, no model written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp: Path, command: str, *args: str) -> subprocess.Popen:
    dlrl = os.path.join(os.path.dirname(sys.executable), "dlrl")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp / "log", "w")
    return subprocess.Popen([dlrl, command, "--config", "configs/tiny.yaml", *args, f"sft.output_dir={tmp / 'tiny-sft'}",
                             "sft.steps=100000"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _stopped_cleanly(proc: subprocess.Popen, tmp: Path) -> str:
    assert proc.wait(timeout=120) == 0
    out = (tmp / "log").read_text()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "SFT stopped by SIGTERM" in out and "no model written" in out, out
    assert not (tmp / "tiny-sft.tmp").exists() and not (tmp / "tiny-sft").exists()
    return out


def test_one_sigterm_stops_the_first_start_sft_of_serve_at_the_step_end(tmp_path):
    proc = _start(tmp_path, "serve", "--port", str(free_port()), "sft.batch_size=2")
    try:
        wait_until(lambda: "sft step 1/" in (tmp_path / "log").read_text() or proc.poll() is not None, 120,
                   "the SFT's first step")
        proc.send_signal(signal.SIGTERM)
        out = _stopped_cleanly(proc, tmp_path)
    finally:
        proc.kill()
    assert "stopping the SFT at the end of this step" in out and "after step" in out


def test_a_second_signal_during_the_sft_of_train_stops_at_once_without_a_traceback(tmp_path):
    proc = _start(tmp_path, "train", f"output_dir={tmp_path / 'run'}", "sft.batch_size=1024")  # long steps
    try:
        wait_until(lambda: (tmp_path / "tiny-sft.tmp").exists() or proc.poll() is not None, 180, "the SFT")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        # the second signal once the first is handled: two signals pending together run in signal-number
        # order (SIGINT first), when the main thread is inside one long torch call
        wait_until(lambda: "SIGTERM: stopping the SFT" in (tmp_path / "log").read_text() or proc.poll() is not None,
                   60, "the first signal handled")
        proc.send_signal(signal.SIGINT)
        out = _stopped_cleanly(proc, tmp_path)
    finally:
        proc.kill()
    assert "second SIGINT: stopping the SFT now" in out
