"""Weights I/O in the Hugging Face SDAR layout (safetensors, optionally sharded).

    model = load_pretrained("path/to/SDAR-1.7B-Chat", dtype=torch.bfloat16)
    save_pretrained(model, "runs/out", max_shard_bytes=2**30)

`copy_into_model` is the single path that writes tensors into parameters
(`param.data.copy_`): checkpoint loading and the weight-sync receiver both use it,
so an in-place update behaves exactly like loading a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dllm.config import SDARConfig
from dllm.model import SDARForCausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class WeightLoadError(ValueError):
    """Weights do not fit the model; the message names the tensor and the problem."""


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype: unknown {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def _params_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    return named


def copy_into_model(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                    strict: bool = True) -> set[str]:
    """Validate every (name, tensor) against the model, then copy all of them in place.

    Nothing is copied unless all names and shapes fit. With strict, every parameter
    (tied weights count once) must be provided. Returns the set of names copied.
    """
    params = _params_by_name(model)
    items = list(named_tensors)
    seen: set[str] = set()
    for name, t in items:
        if name not in params:
            raise WeightLoadError(f"unexpected tensor {name!r}: the model has no such parameter")
        if tuple(t.shape) != tuple(params[name].shape):
            raise WeightLoadError(f"shape mismatch for {name!r}: got {tuple(t.shape)}, "
                                  f"model has {tuple(params[name].shape)}")
        if name in seen:
            raise WeightLoadError(f"tensor {name!r} given twice")
        seen.add(name)
    if strict:
        by_id: dict[int, list[str]] = {}
        for n, p in params.items():
            by_id.setdefault(id(p), []).append(n)
        missing = [names[0] for names in by_id.values() if not any(n in seen for n in names)]
        if missing:
            raise WeightLoadError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    with torch.no_grad():
        for name, t in items:
            params[name].data.copy_(t)
    return seen


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
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


def iter_checkpoint(path: str | Path) -> Iterable[tuple[str, torch.Tensor]]:
    for f in _weight_files(Path(path)):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def load_pretrained(path: str | Path, device: str | torch.device = "cpu",
                    dtype: str | torch.dtype | None = None) -> SDARForCausalLM:
    """Build the model from `path/config.json` and copy the safetensors weights into it."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    cfg = SDARConfig.from_json_file(path / "config.json")
    dtype = parse_dtype(dtype) or torch.float32
    with torch.device("meta"):
        model = SDARForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    tensors = dict(iter_checkpoint(path))
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    copy_into_model(model, tensors.items(), strict=True)
    return model.eval()


def save_pretrained(model: SDARForCausalLM, path: str | Path, max_shard_bytes: int = 4 << 30,
                    dtype: str | torch.dtype | None = None) -> None:
    """Write config.json and safetensors shards (+ index when more than one shard)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    state = {}
    for name, p in model.named_parameters():  # tied weights appear once
        t = p.detach()
        state[name] = (t.to(dtype) if dtype else t).contiguous().cpu()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    cfg = model.config
    if dtype:
        cfg.torch_dtype = str(dtype).removeprefix("torch.")
    cfg.save(path)
    for old in list(path.glob("model*.safetensors")) + [path / INDEX_NAME]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2))
