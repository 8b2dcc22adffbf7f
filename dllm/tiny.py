"""The embedded default: a tiny SDAR model trained by the project itself.

    path = ensure_default_model("configs/tiny.yaml")   # trains it first if missing

Sections of configs/tiny.yaml used here: `model` (TinyModelConfig), `task`
(ArithmeticTask) and `sft` (SFTConfig). A file lock makes concurrent callers (a server
and a trainer started together) train it once.
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path

from dllm.configlib import load_section
from dllm.sft import SFTConfig, TinyModelConfig, run_sft
from dllm.task import ArithmeticTask

log = logging.getLogger("dlrl.tiny")
DEFAULT_CONFIG = "configs/tiny.yaml"


def load_tiny_sections(config_path: str | Path | None = DEFAULT_CONFIG, overrides: list[str] | None = None,
                       primary: str | None = None):
    """(model, task, sft) sections; bare `key=value` overrides apply to `primary` only."""
    arch = load_section(TinyModelConfig, config_path, "model", overrides, bare_keys=primary == "model")
    task = load_section(ArithmeticTask, config_path, "task", overrides, bare_keys=primary == "task")
    sft = load_section(SFTConfig, config_path, "sft", overrides, bare_keys=primary == "sft")
    return arch, task, sft


def ensure_default_model(config_path: str | Path | None = DEFAULT_CONFIG,
                         overrides: list[str] | None = None) -> Path:
    """Return the embedded default's model folder, running SFT first if it is missing."""
    arch, task, sft = load_tiny_sections(config_path, overrides)
    out = Path(sft.output_dir)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            log.info("no model at %s yet: training the embedded default (SFT, ~1-2 min on CPU)", out)
            run_sft(arch, task, sft)
    return out
