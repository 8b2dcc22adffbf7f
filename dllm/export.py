"""Export a policy as a Hugging Face folder that other tools load like the source checkpoint.

    export_pretrained(model.hf_named_tensors(), model.config, "runs/x/final",
                      source_dir="/models/SDAR-1.7B-Chat")          # dtype: the source's
    AutoModelForCausalLM.from_pretrained("runs/x/final", trust_remote_code=True)   # same logits
    AutoTokenizer.from_pretrained("runs/x/final")

What the folder holds:
- `config.json`: the source's, every field kept (only `torch_dtype`/`dtype` follow the saved
  dtype; `block_size` / `mask_token_id` are added when the source lacked them); without a
  source, the model's own config;
- the source's modeling code (`*.py`), tokenizer files and `generation_config.json`; where
  `auto_map` names `configuration_sdar` / `modeling_sdar` and the source has no such file
  (or there is no `auto_map`), the project's own transformers-compatible SDAR files
  (dllm/hf_sdar/) are shipped and referenced;
- a `generation_config.json` (eos ids: config.json's plus the tokenizer's) when the source has none;
- LLaDA / Dream (a `dllm.full.config.FullAttentionConfig`): the official config.json (the source's, or
  the model's own official fields), no SDAR files shipped, a generation_config.json when the source has none;
- the weights as safetensors shards, in the source dtype unless `dtype` says otherwise,
  written one shard at a time from the (name, tensor) stream.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

from dllm.config import SDARConfig, read_config_json
from dllm.full.config import FullAttentionConfig
from dllm.tokenizer import find_token_id
from dllm.weights import parse_dtype, save_weights

T = TypeVar("T")
log = logging.getLogger("dlrl.model")
HF_FILES_DIR = Path(__file__).parent / "hf_sdar"
OWN_MODULES = ("configuration_sdar", "modeling_sdar")
OWN_AUTO_MAP = {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_config(config: SDARConfig, source_dir: Path | None, dtype_name: str | None) -> dict:
    """config.json of the export: the source's fields verbatim, plus what it lacked."""
    data = read_config_json(source_dir) if source_dir and (source_dir / "config.json").is_file() \
        else config.to_dict()
    data.setdefault("block_size", config.block_size)
    data.setdefault("mask_token_id", config.mask_token_id)
    data.setdefault("architectures", ["SDARForCausalLM"])
    data.setdefault("auto_map", dict(OWN_AUTO_MAP))
    if dtype_name:
        data["torch_dtype"] = dtype_name
        if "dtype" in data:
            data["dtype"] = dtype_name
    return data


def full_export_config(config: FullAttentionConfig, source_dir: Path | None, dtype_name: str | None) -> dict:
    """config.json of a LLaDA / Dream export: the source's fields verbatim (else the model's official
    config), `auto_map` kept; the modeling code is the source's (copied when it has it; dlrl ships none)."""
    data = read_config_json(source_dir) if source_dir and (source_dir / "config.json").is_file() \
        else config.to_dict()
    data.setdefault("mask_token_id", config.mask_token_id)
    if dtype_name:
        data["torch_dtype"] = dtype_name
        if "dtype" in data:
            data["dtype"] = dtype_name
    return data


def copy_side_files(source_dir: Path, out: Path) -> list[str]:
    """Copy modeling code, tokenizer files and generation_config.json; returns their names."""
    names = []
    for f in sorted(source_dir.iterdir()):
        if f.is_file() and (f.suffix == ".py" or f.name in TOKENIZER_FILES or f.name == "generation_config.json"):
            shutil.copy2(f, out / f.name)
            names.append(f.name)
    return names


def ship_modeling_files(auto_map: dict, out: Path) -> None:
    """Write the project's SDAR modeling files for every auto_map module the folder lacks."""
    for ref in auto_map.values():
        refs = ref if isinstance(ref, list) else [ref]
        for r in refs:
            if not isinstance(r, str) or "." not in r:
                continue
            module = r.split("--")[-1].rsplit(".", 1)[0]
            if (out / f"{module}.py").is_file():
                continue
            if module in OWN_MODULES:
                shutil.copy2(HF_FILES_DIR / f"{module}.py", out / f"{module}.py")
            else:
                log.warning("export: auto_map names %s but neither the source nor dlrl has %s.py", r, module)


def write_generation_config(config: SDARConfig, out: Path) -> None:
    eos = set(config.eos_ids)
    tok_cfg = out / "tokenizer_config.json"
    if tok_cfg.is_file():
        name = json.loads(tok_cfg.read_text()).get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        tid = find_token_id(out, name) if isinstance(name, str) else None
        if tid is not None:
            eos.add(tid)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": sorted(eos) if len(eos) != 1 else eos.pop(),
           "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def export_pretrained(named_tensors: Iterable[tuple[str, torch.Tensor]], config: SDARConfig | FullAttentionConfig,
                      out_dir: str | Path, source_dir: str | Path | None = None,
                      dtype: str | torch.dtype | None = None, max_shard_bytes: int = 4 << 30) -> Path:
    """Write the export folder (see the module docstring) and return it. `named_tensors` is
    consumed once (HF names, tied weights once, e.g. `model.hf_named_tensors()`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(source_dir) if source_dir else None
    if source is not None and not source.is_dir():
        raise FileNotFoundError(f"export: source folder not found: {source}")
    if source is not None and source.resolve() == out.resolve():
        raise ValueError(f"export: the output folder must not be the source folder ({source})")
    dtype = parse_dtype(dtype)
    if dtype is None and source is not None:
        src = read_config_json(source) if (source / "config.json").is_file() else {}
        dtype = parse_dtype(src.get("torch_dtype") or src.get("dtype") or None)
    copied = copy_side_files(source, out) if source is not None else []
    if isinstance(config, FullAttentionConfig):  # LLaDA / Dream: the official layout, no SDAR files
        data = full_export_config(config, source, _dtype_name(dtype) if dtype else None)
        if "generation_config.json" not in copied:
            from dllm.full.load import generation_config

            (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
    else:
        data = export_config(config, source, _dtype_name(dtype) if dtype else None)
        ship_modeling_files(data["auto_map"], out)
        if "generation_config.json" not in copied:
            write_generation_config(config, out)
    if dtype is None:  # no source and no request: keep the tensors' own dtype
        named_tensors = iter(named_tensors)
        first = next(named_tensors)
        data["torch_dtype"] = _dtype_name(first[1].dtype)
        named_tensors = _chain(first, named_tensors)
    save_weights(named_tensors, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    log.info("exported %s (%s, files from %s)", out, data["torch_dtype"], source or "the model config")
    return out


def _chain(first: T, rest: Iterable[T]) -> Iterator[T]:
    yield first
    yield from rest
