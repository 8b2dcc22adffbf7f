"""Weights I/O in the Hugging Face SDAR layout (safetensors, optionally sharded), streamed.

    model = load_pretrained("path/to/SDAR-1.7B-Chat", dtype=torch.bfloat16)
    model = load_pretrained(folder_without_block_size, block_size=4)
    save_pretrained(model, "runs/out", max_shard_bytes=2**30)
    save_weights(named_tensors, "runs/out", dtype=torch.bfloat16)   # any (name, tensor) stream

The family-free pieces (safetensors shards streamed in and out, `copy_into_model`: the single path that
writes tensors into parameters, also the weight-sync receiver's) live in dllm.checkpoint and are re-exported
here. `load_pretrained` picks the family from config.json: a LLaDA / Dream folder loads through dllm.full.load.
Names are always the HF ones (`hf_tensors(model)`).

Loading streams: the model is allocated once (on the meta device first, then empty in
the target dtype and device), every name and shape is checked against the safetensors
headers before any data is read, then the shards are read one at a time, one tensor at a
time (large tensors a few rows at a time), straight into the parameters. Peak memory is
about the model plus one shard (the shard's pages are mapped while it is read). Saving converts and writes a shard at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch

from dllm.checkpoint import (
    CHUNK_BYTES,
    DTYPES,
    IGNORED_SUFFIXES,
    INDEX_NAME,
    SINGLE_NAME,
    ChunkedTensor,
    Spec,
    WeightLoadError,
    checkpoint_specs,
    copy_into_model,
    hf_tensors,
    iter_checkpoint,
    parse_dtype,
    save_weights,
    weight_files,
)
from dllm.config import SDARConfig, load_model_config
from dllm.meta import materialize, on_meta
from dllm.model import SDARForCausalLM

if TYPE_CHECKING:
    from dllm.full.model import FullAttentionLM

DiffusionLM = Union[SDARForCausalLM, "FullAttentionLM"]  # what load_pretrained returns (model.attention tells)
__all__ = ["CHUNK_BYTES", "DTYPES", "IGNORED_SUFFIXES", "INDEX_NAME", "SINGLE_NAME", "ChunkedTensor", "DiffusionLM", "Spec",
           "WeightLoadError", "checkpoint_specs", "copy_into_model", "empty_model", "hf_tensors", "iter_checkpoint",
           "load_pretrained", "parse_dtype", "save_pretrained", "save_weights", "weight_files"]


def empty_model(cfg: SDARConfig, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> SDARForCausalLM:
    """An SDARForCausalLM with uninitialised parameters of `dtype` on `device` (allocated once)."""
    with on_meta():
        model = SDARForCausalLM(cfg)
    model = materialize(model, device, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                    block_size: int | None = None, mask_token_id: int | None = None) -> DiffusionLM:
    """Build the model from `path/config.json` and stream the safetensors weights into it.
    `block_size` / `mask_token_id` are for folders that lack them (see load_model_config).
    A LLaDA or Dream folder (dllm.full.config.detect_family) loads as a `dllm.full.FullAttentionLM`
    (`load_model` is the same, typed for both)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    from dllm.full.config import folder_family

    if folder_family(path) != "sdar":  # LLaDA / Dream: full attention (dllm.full)
        from dllm.full.load import load_full_pretrained

        return load_full_pretrained(path, device, dtype, block_size=block_size, mask_token_id=mask_token_id)
    cfg = load_model_config(path, block_size=block_size, mask_token_id=mask_token_id)
    model = empty_model(cfg, device, parse_dtype(dtype) or torch.float32)
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    specs = checkpoint_specs(path, skip)
    copy_into_model(model, iter_checkpoint(path, skip, chunked=True), strict=True, specs=specs)
    return model.eval()


def save_pretrained(model: DiffusionLM, path: str | Path, max_shard_bytes: int = 4 << 30,
                    dtype: str | torch.dtype | None = None) -> None:
    """Write config.json (torch_dtype = the saved dtype) and the safetensors shards."""
    dtype = parse_dtype(dtype)
    cfg = model.config
    if dtype:
        cfg.torch_dtype = str(dtype).removeprefix("torch.")
    cfg.save(path)
    save_weights(hf_tensors(model), path, dtype=dtype, max_shard_bytes=max_shard_bytes)
