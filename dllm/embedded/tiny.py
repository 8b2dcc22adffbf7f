"""The embedded default: a tiny SDAR model trained by the project itself.

    arch, task, sft = load_tiny_sections("configs/tiny.yaml")
    path = ensure_default_model(arch, task, sft)        # trains it first if missing
    random_tiny_folder("runs/x", **SMALL_ARCH)          # random weights (tests, benchmarks)

Sections of configs/tiny.yaml used here: `model` (TinyModelConfig), `task`
(ArithmeticTask) and `sft` (SFTConfig). A file lock makes concurrent callers (a server
and a trainer started together) train it once.
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path
from typing import Any, cast

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


def ensure_default_model(arch: TinyModelConfig, task: ArithmeticTask, sft: SFTConfig) -> Path:
    """Return the embedded default's model folder, running SFT first if it is missing."""
    out = Path(sft.output_dir)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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
