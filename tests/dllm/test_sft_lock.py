"""The embedded default's SFT lock never makes a caller wait silently (issue 47): a second process that
finds another one training the folder logs who holds the lock and that process's own progress line, again
every WAIT_LOG_S, and returns the folder once the holder has written it (without training it again).

    python -m pytest -q tests/dllm/test_sft_lock.py
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from dllm.embedded import tiny
from dllm.embedded.sft_config import SFTConfig, TinyModelConfig
from dllm.embedded.task import ArithmeticTask
from tests.helpers import wait_until

HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    with open(out.parent / f".{out.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0); lock.write(f"{os.getpid()}\\n"); lock.flush()
        tmp = out.with_name(out.name + ".tmp"); tmp.mkdir()
        (tmp / "progress").write_text("sft step 300/900 loss 0.5 | 2.0 steps/s | 2 min 30 s elapsed, ~5 min 00 s left\\n")
        print("holding", flush=True)
        sys.stdin.readline()                      # the test says when the "training" is done
        tmp.rename(out); (out / "config.json").write_text("{}")
""")


def test_a_waiter_logs_the_holder_and_its_progress_then_returns_its_model(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "tiny-sft"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        monkeypatch.setattr(tiny, "WAIT_LOG_S", 0.6)
        monkeypatch.setattr(tiny, "POLL_S", 0.05)
        caplog.set_level(logging.INFO, logger="dlrl.tiny")
        result: list[Path] = []
        waiter = threading.Thread(target=lambda: result.append(tiny.ensure_default_model(
            TinyModelConfig(), ArithmeticTask(), SFTConfig(output_dir=str(out)))))
        waiter.start()

        def said(text: str) -> bool:
            return any(text in r.getMessage() for r in caplog.records)

        wait_until(lambda: said("waiting for pid"), 10, "the first wait line")
        first = next(r.getMessage() for r in caplog.records if "waiting for pid" in r.getMessage())
        assert f"waiting for pid {holder.pid}: sft step 300/900" in first and "~5 min 00 s left" in first, first
        assert str(out) in first and ".tiny-sft.lock" in first
        wait_until(lambda: said("still waiting for the embedded default"), 10, "a repeated wait line")
        assert waiter.is_alive() and not result
        holder.communicate("done\n", timeout=10)
        waiter.join(timeout=10)
        assert result == [out] and said("is free after")
        assert not said("training the embedded default first")  # the holder's model is used, not trained again
    finally:
        holder.kill()
        holder.wait()
