"""Model families from a folder's config.json fields alone (torch-free: `--check` reads it without loading
weights; nothing from the folder is imported or executed).

    detect_family({"model_type": "llada"})     # "llada"
    folder_family("runs/tiny-sft")             # "sdar"

`sdar` is block-causal (SDAR / TraDo, also `trado`, `qwen3`); `llada` and `dream` are full attention
(dllm/full/). The family comes from `model_type`, else `architectures`, else the module names of `auto_map`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from dllm.config import ConfigValueError, read_config_json

Family = Literal["sdar", "llada", "dream"]
FULL_FAMILIES = ("llada", "dream")
SDAR_TYPES = ("sdar", "trado", "qwen3")
_MARKERS: tuple[tuple[Family, tuple[str, str]], ...] = (
    ("llada", ("LLaDAModelLM", "modeling_llada")), ("dream", ("DreamModel", "modeling_dream")),
    ("sdar", ("SDARForCausalLM", "modeling_sdar")))


def detect_family(d: dict[str, Any]) -> Family:
    """The model family of a config.json dict, from its fields only (ConfigValueError naming
    `model_type` when none matches)."""
    mt = str(d.get("model_type", "")).lower()
    if mt == "llada":
        return "llada"
    if mt == "dream":
        return "dream"
    if mt in SDAR_TYPES:
        return "sdar"
    arch = " ".join(str(a) for a in d.get("architectures") or [])
    auto = " ".join(str(v) for v in (d.get("auto_map") or {}).values()) if isinstance(d.get("auto_map"), dict) else ""
    for family, names in _MARKERS:
        if any(n in arch or n in auto for n in names):
            return family
    raise ConfigValueError(f"model_type: unsupported {d.get('model_type')!r} (supported: "
                           f"{', '.join(SDAR_TYPES)} (block-causal SDAR / TraDo), llada, Dream (full attention))")


def folder_family(folder: str | Path) -> Family:
    """The family of a model folder (its config.json)."""
    return detect_family(read_config_json(folder))
