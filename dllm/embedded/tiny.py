"""The embedded default: a tiny SDAR model trained by the project itself.

    arch, task, sft = load_tiny_sections("configs/tiny.yaml")
    path = ensure_default_model(arch, task, sft)        # trains it first if missing
    random_tiny_folder("runs/x", **SMALL_ARCH)          # random weights (tests, benchmarks)

Sections of configs/tiny.yaml used here: `model` (TinyModelConfig), `task`
(ArithmeticTask) and `sft` (SFTConfig). A file lock makes concurrent callers (a server
and a trainer started together, or `dlrl sft`) train it once; a caller that finds the lock
held never waits silently: it logs who holds it and that process's own progress line
(`sft step 300/900 ... ~1 min left`, read from `<output_dir>.tmp/progress`) every
`WAIT_LOG_S` seconds until the model appears.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

from dllm.embedded.sft_config import SFTConfig, TinyModelConfig
from dllm.embedded.task import ArithmeticTask
from dlrl_config import Config, load_sections

log = logging.getLogger("dlrl.tiny")
DEFAULT_CONFIG = "configs/tiny.yaml"


TINY_SECTIONS: dict[str, type[Config]] = {"model": TinyModelConfig, "task": ArithmeticTask, "sft": SFTConfig}


def load_tiny_sections(config_path: str | Path | None = DEFAULT_CONFIG, overrides: list[str] | None = None,
                       primary: str | None = None) -> tuple[TinyModelConfig, ArithmeticTask, SFTConfig]:
    """(model, task, sft) sections, read from the file once. Overrides of other sections are
    not theirs (skipped); bare `key=value` ones apply to `primary` only."""
    mine = []
    for item in overrides or []:
        key = item.split("=", 1)[0]
        if (key.split(".", 1)[0] if "." in key else primary) in TINY_SECTIONS:
            mine.append(item)
    secs = load_sections(config_path, mine, TINY_SECTIONS, primary=primary or "sft")
    return (cast(TinyModelConfig, secs["model"]), cast(ArithmeticTask, secs["task"]),
            cast(SFTConfig, secs["sft"]))


WAIT_LOG_S = 15.0  # a waiter's status line at least this often
POLL_S = 0.5
PROGRESS_FILE = "progress"  # inside <output_dir>.tmp: the trainer's last progress line (dllm.embedded.sft)


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def _holder(lock: IO[str], out: Path) -> str:
    """'pid 123: sft step 300/900 ... ~1 min left' (what the lock holder wrote; progress when it has any)."""
    lock.seek(0)
    pid = lock.read().strip()
    try:
        progress = (out.with_name(out.name + ".tmp") / PROGRESS_FILE).read_text().strip()
    except OSError:
        progress = ""
    who = f"pid {pid}" if pid.isdigit() else "another process"
    return f"{who}: {progress}" if progress else f"{who} (no progress reported yet)"


@contextmanager
def sft_lock(out: Path, wait_log_s: float | None = None) -> Iterator[None]:
    """Hold the training lock of `out` (one SFT of a folder at a time, across processes). While another
    process holds it, log what this one waits for, with that process's progress, every `wait_log_s`
    (default WAIT_LOG_S)."""
    every = WAIT_LOG_S if wait_log_s is None else wait_log_s
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(out), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = last = time.monotonic()
            log.info("waiting for %s to finish training the embedded default into %s (lock %s): this process "
                     "goes on once it is done", _holder(lock, out), out, lock_path(out))
            while True:
                time.sleep(POLL_S)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - last >= every:
                        last = time.monotonic()
                        log.info("still waiting for the embedded default (%.0f s so far): %s", last - t0,
                                 _holder(lock, out))
            log.info("the lock on %s is free after %.0f s", out, time.monotonic() - t0)
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        try:
            yield
        finally:
            lock.truncate(0)


def ensure_default_model(arch: TinyModelConfig, task: ArithmeticTask, sft: SFTConfig) -> Path:
    """Return the embedded default's model folder, running SFT first if it is missing (or waiting,
    with log lines, for the process that is training it)."""
    out = Path(sft.output_dir)
    if (out / "config.json").is_file():
        return out
    with sft_lock(out):
        if not (out / "config.json").is_file():
            from dllm.embedded.sft import run_sft

            log.info("no model at %s yet: training the embedded default first (SFT: 1-2 min on 2 idle CPU cores, "
                     "up to ~25 on a loaded box; progress with the time left below)", out)
            run_sft(arch, task, sft)
    return out


# the small architecture of the test suite's random model (and benchmarks/flood.py's)
SMALL_ARCH = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}


def random_tiny_folder(path: str | Path, arch: TinyModelConfig | None = None, seed: int = 0, **fields: Any) -> str:
    """A model folder (HF layout, char tokenizer) with random weights (`torch.manual_seed(seed)`) of
    `arch`, default TinyModelConfig(**fields): what tests and benchmarks serve when they need no
    trained model. `random_tiny_folder(tmp, **SMALL_ARCH)` is the test suite's."""
    import torch

    from dllm.embedded.sft import make_model_config
    from dllm.model import SDARForCausalLM
    from dllm.tokenizer import build_char_tokenizer
    from dllm.weights import save_pretrained

    tok = build_char_tokenizer(path)
    torch.manual_seed(seed)
    save_pretrained(SDARForCausalLM(make_model_config(arch or TinyModelConfig(**fields), tok)), path)
    return str(path)
