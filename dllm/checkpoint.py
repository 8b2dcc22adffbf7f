"""Checkpoint I/O that knows no model family: safetensors shards read and written a tensor at a time, and the
one path that writes tensors into parameters.

    for name, t in iter_checkpoint(folder, chunked=True): ...      # one shard, one tensor (or row chunk) at a time
    copy_into_model(model, named_tensors, strict=True, specs=checkpoint_specs(folder))
    save_weights(named_tensors, "runs/out", dtype=torch.bfloat16)    # any (name, tensor) stream, sharded

`copy_into_model` is the single path that writes tensors into parameters (`param.data.copy_`): checkpoint
loading (dllm.weights for SDAR, dllm.full.load for LLaDA / Dream) and the weight-sync receiver both use it, so
an in-place update behaves exactly like loading a checkpoint. A q/k/v or gate/up tensor is copied into its
rows of the model's fused parameter, in place. Every name and shape is checked against the safetensors
headers before any data is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, overload

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here
CHUNK_BYTES = 16 << 20  # larger checkpoint tensors are read into their parameter in row chunks
Spec = tuple[str, tuple[int, ...]]


class WeightLoadError(ValueError):
    """Weights do not fit the model; the message names the tensor (or file) and the problem."""


@overload
def parse_dtype(name: str | torch.dtype) -> torch.dtype: ...
@overload
def parse_dtype(name: None) -> None: ...
def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype: unknown {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def _check_specs(params: dict[str, torch.Tensor], specs: Iterable[Spec], strict: bool) -> dict[str, tuple]:
    """Validate (name, shape) pairs against the model; returns {name: shape}."""
    seen: dict[str, tuple] = {}
    for name, shape in specs:
        if name not in params:
            raise WeightLoadError(f"unexpected tensor {name!r}: the model has no such parameter")
        if tuple(shape) != tuple(params[name].shape):
            raise WeightLoadError(f"shape mismatch for {name!r}: got {tuple(shape)}, "
                                  f"model has {tuple(params[name].shape)}")
        if name in seen:
            raise WeightLoadError(f"tensor {name!r} given twice")
        seen[name] = tuple(shape)
    if strict:
        by_id: dict[int, list[str]] = {}
        for n, p in params.items():
            by_id.setdefault(id(p), []).append(n)
        missing = [names[0] for names in by_id.values() if not any(n in seen for n in names)]
        if missing:
            raise WeightLoadError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    return seen


def hf_tensors(model: torch.nn.Module, remove_duplicate: bool = True) -> Iterable[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of a model's weights: `model.hf_named_tensors()` (fused parameters
    split into views) where the model has it, else its named parameters."""
    fn = getattr(model, "hf_named_tensors", None)
    return fn(remove_duplicate=remove_duplicate) if fn is not None else \
        model.named_parameters(remove_duplicate=remove_duplicate)


def copy_into_model(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor | ChunkedTensor]],
                    strict: bool = True, specs: Sequence[Spec] | None = None) -> set[str]:
    """Validate every (name, tensor) against the model, then copy them in place.

    Without `specs`, the tensors are collected first (a list costs nothing more) and nothing
    is copied unless all names and shapes fit. With `specs` ((name, shape) of everything
    the stream will yield, e.g. from safetensors headers) the check runs on them first and
    the stream is then consumed one tensor at a time (a tensor that contradicts its spec
    still raises). With strict, every parameter (tied weights count once) must be provided.
    Returns the set of names copied."""
    params = dict(hf_tensors(model, remove_duplicate=False))
    if specs is None:
        named_tensors = named_tensors if isinstance(named_tensors, (list, tuple)) else list(named_tensors)
        specs = [(n, tuple(t.shape)) for n, t in named_tensors]
    expected = _check_specs(params, specs, strict)
    copied: set[str] = set()
    with torch.no_grad():
        for name, t in named_tensors:
            if expected.get(name) != tuple(t.shape) or name in copied:
                raise WeightLoadError(f"tensor {name!r} {tuple(t.shape)} does not match the announced specs")
            if isinstance(t, ChunkedTensor):
                t.copy_to(params[name].data)
            else:
                params[name].data.copy_(t)
            copied.add(name)
    if copied != set(expected):
        missing = sorted(set(expected) - copied)
        raise WeightLoadError(f"stream ended before tensor {missing[0]!r} ({len(missing)} announced, not sent)")
    return copied


def weight_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif (path / SINGLE_NAME).is_file():
        files = [path / SINGLE_NAME]
    else:
        raise FileNotFoundError(f"no {SINGLE_NAME} or {INDEX_NAME} in {path}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight shard listed in the index is missing: {f}")
    return files


def _keep(name: str, skip: AbstractSet[str]) -> bool:
    return name not in skip and not name.endswith(IGNORED_SUFFIXES)


def checkpoint_specs(path: str | Path, skip: AbstractSet[str] = frozenset()) -> list[Spec]:
    """(name, shape) of every tensor in the folder's shards, from the headers only."""
    specs = []
    for f in weight_files(Path(path)):
        try:
            with safe_open(str(f), framework="pt") as fh:
                specs += [(n, tuple(fh.get_slice(n).get_shape())) for n in fh.keys() if _keep(n, skip)]
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise WeightLoadError(f"{f}: not a readable safetensors file ({e})") from e
    return specs


class ChunkedTensor:
    """A checkpoint tensor that `copy_into_model` reads straight into its parameter, a few rows
    at a time (no full-size temporary copy of a large tensor)."""

    def __init__(self, handle: Any, name: str) -> None:  # a safetensors safe_open handle
        self.slice = handle.get_slice(name)
        self.shape = tuple(self.slice.get_shape())

    def copy_to(self, dst: torch.Tensor) -> None:
        row_bytes = max(1, dst[0].numel() * dst.element_size()) if dst.dim() else 1
        step = max(1, CHUNK_BYTES // row_bytes)
        for i in range(0, self.shape[0], step):
            dst[i:i + step].copy_(self.slice[i:i + step])


def iter_checkpoint(path: str | Path, skip: AbstractSet[str] = frozenset(),
                    chunked: bool = False) -> Iterable[tuple[str, torch.Tensor | ChunkedTensor]]:
    """Yield (name, tensor) one at a time, shard by shard (one shard mapped at a time). With
    `chunked`, tensors over CHUNK_BYTES come as ChunkedTensor (for copy_into_model)."""
    for f in weight_files(Path(path)):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if not _keep(name, skip):
                    continue
                big = chunked and fh.get_slice(name).get_shape() and \
                    math.prod(fh.get_slice(name).get_shape()) * 4 > CHUNK_BYTES
                yield name, ChunkedTensor(fh, name) if big else fh.get_tensor(name)


def save_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], path: str | Path,
                 dtype: str | torch.dtype | None = None, max_shard_bytes: int = 4 << 30) -> None:
    """Write (name, tensor) pairs as safetensors shards (+ index when more than one), a shard
    at a time: only one shard's converted copy is in memory. Replaces older weight files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    for old in list(path.glob("model*.safetensors")) + [path / INDEX_NAME]:
        old.unlink(missing_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        tmp = path / f".shard-{len(parts):05d}.safetensors.tmp"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        parts.append((tmp, list(shard)))

    for name, t in named_tensors:
        t = (t.detach().to(dtype) if dtype else t.detach()).contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t
        size, total = size + nbytes, total + nbytes
    if shard or not parts:
        flush()
    shard = {}
    if len(parts) == 1:
        parts[0][0].rename(path / SINGLE_NAME)
        return
    weight_map = {}
    for i, (tmp, names) in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        tmp.rename(path / fname)
        weight_map.update(dict.fromkeys(names, fname))
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2))
