"""Load and save LLaDA / Dream folders as published: streamed safetensors, official names, no code execution.

    model = load_full_pretrained("/models/LLaDA-8B-Instruct", dtype=torch.bfloat16, block_size=32)
    model = dllm.weights.load_pretrained(folder)        # the same: it dispatches on the config's family
    save_full_pretrained(model, "runs/out", source_dir="/models/LLaDA-8B-Instruct")   # official layout back

Loading is dllm.weights' streaming path (headers checked first, one shard and one tensor at a time, large
tensors in row chunks, straight into parameters allocated once on the target device). Saving writes the
official config.json (the source's fields, `auto_map` kept), generation_config.json, the source's
tokenizer files and modeling code when there is a source, and the weights under their official names
(dllm.export.export_pretrained does the same for any model: it dispatches here).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dllm.full.config import FullAttentionConfig, load_full_config
from dllm.full.model import FullAttentionLM
from dllm.meta import materialize, on_meta

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")


def empty_full_model(cfg: FullAttentionConfig, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> FullAttentionLM:
    """A FullAttentionLM with uninitialised parameters of `dtype` on `device` (allocated once)."""
    with on_meta():
        model = FullAttentionLM(cfg)
    return materialize(model, device, dtype)


def tied_skip(cfg: FullAttentionConfig) -> set[str]:
    """Checkpoint tensors a tied model has no parameter for (some folders still carry them)."""
    if not cfg.tie_word_embeddings:
        return set()
    return {"model.transformer.ff_out.weight"} if cfg.family == "llada" else {"lm_head.weight"}


def load_full_pretrained(path: str | Path, device: str | torch.device = "cpu",
                         dtype: str | torch.dtype | None = None, block_size: int | None = None,
                         mask_token_id: int | None = None) -> FullAttentionLM:
    """Build the model from `path/config.json` and stream the safetensors weights into it (eval mode)."""
    from dllm.checkpoint import checkpoint_specs, copy_into_model, iter_checkpoint, parse_dtype

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    cfg = load_full_config(path, block_size=block_size, mask_token_id=mask_token_id)
    model = empty_full_model(cfg, device, parse_dtype(dtype) or torch.float32)
    skip = tied_skip(cfg)
    specs = checkpoint_specs(path, skip)
    copy_into_model(model, iter_checkpoint(path, skip, chunked=True), strict=True, specs=specs)
    return model.eval()


def generation_config(cfg: FullAttentionConfig) -> dict:
    """generation_config.json for a folder that has none (eos ids: the config's)."""
    eos = cfg.eos_ids
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": cfg.pad_token_id, "mask_token_id": cfg.mask_token_id}


def save_full_pretrained(model: FullAttentionLM, out_dir: str | Path, source_dir: str | Path | None = None,
                         dtype: str | torch.dtype | None = None, max_shard_bytes: int = 4 << 30) -> Path:
    """Write the official layout: config.json (the source's or the model's, torch_dtype = the saved dtype),
    generation_config.json, tokenizer files and modeling code of the source, safetensors shards."""
    from dllm.checkpoint import parse_dtype, save_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(source_dir) if source_dir is not None else None
    if source is not None and source.resolve() == out.resolve():
        raise ValueError(f"export: the output folder must not be the source folder ({source})")
    dt = parse_dtype(dtype) or model.dtype
    cfg = model.config
    cfg.torch_dtype = str(dt).removeprefix("torch.")
    copied = []
    if source is not None:
        for f in sorted(source.iterdir()):
            if f.is_file() and (f.suffix == ".py" or f.name in TOKENIZER_FILES or f.name == "generation_config.json"):
                shutil.copy2(f, out / f.name)
                copied.append(f.name)
    if "generation_config.json" not in copied:
        (out / "generation_config.json").write_text(json.dumps(generation_config(cfg), indent=2) + "\n")
    save_weights(model.hf_named_tensors(), out, dtype=dt, max_shard_bytes=max_shard_bytes)
    cfg.save(out)
    return out
