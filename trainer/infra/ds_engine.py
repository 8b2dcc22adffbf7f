"""DeepSpeed engine for the trainer: config, init, full-parameter access, checkpoints, HF export.

    cfg = DSConfig(zero_stage=2, dtype="bf16", grad_accum=4, grad_clip=1.0, lr=1e-6)
    engine = build_engine(model, cfg)            # once per run: optimizer state lives in it
    for micro in batches:                        # grad_accum micro-batches = one optimizer step
        engine.backward(loss_fn(engine, micro))  # DeepSpeed divides the loss by grad_accum
        engine.step()                            # clips + steps at the accumulation boundary
    push(named_full_params(engine))              # weight sync (every rank must iterate: ZeRO-3)
    save_checkpoint(engine, "runs/x/ckpt", {"step": 7, "version": 7, "sampler": {...}})
    state = load_checkpoint(engine, "runs/x/ckpt")   # into a freshly built engine on resume
    export_hf(engine, model.config, "runs/x/hf", source_dir="/models/SDAR")  # loads in transformers

CPU: accelerator `cpu` (DS_ACCELERATOR, set before DeepSpeed is imported), gloo, ZeRO 0-3,
fp32/bf16. CUDA: nccl. The optimizer is a torch AdamW handed to `deepspeed.initialize` (no
extension to compile). A second `build_engine` (value model) reuses the process group.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast, runtime_checkable

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from dllm.config import SDARConfig
    from dllm.full.config import FullAttentionConfig
    from dllm.full.model import FullAttentionLM
    from dllm.model import SDARForCausalLM

    Policy = SDARForCausalLM | FullAttentionLM

from dllm.export import export_pretrained
from trainer.infra.dist import init_process_group
from weight_sync.sources import ZeroParam, module_layout, split_parts

M = TypeVar("M", bound=nn.Module)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CLIENT_STATE = "client_state.json"


@dataclass
class DSConfig:
    zero_stage: int = 0  # 0-3
    dtype: str = "fp32"  # "fp32" | "bf16" (bf16 keeps fp32 master weights in the optimizer)
    micro_batch_size: int = 1  # rows per micro-batch (DeepSpeed bookkeeping only)
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    lr: float = 1e-6
    weight_decay: float = 0.0  # not applied to 1-D params (norms, biases)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0  # linear LR warmup over optimizer steps; 0 = constant LR
    gradient_checkpointing: bool = False
    compile_layers: bool = False  # torch.compile each decoder layer (model.compile_layers) before wrapping
    ds_overrides: dict[str, Any] = field(default_factory=dict)  # deep-merged into the DS config

    def validate(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage: expected 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("micro_batch_size", "grad_accum"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        for name in ("grad_clip", "lr", "weight_decay", "eps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {self.betas!r}")

    def to_ds_config(self, world_size: int = 1) -> dict[str, Any]:
        """The DeepSpeed JSON config (no optimizer section: the optimizer is passed in)."""
        self.validate()
        conf: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "train_batch_size": self.micro_batch_size * self.grad_accum * world_size,
            "gradient_clipping": float(self.grad_clip),
            "zero_optimization": {"stage": self.zero_stage},
            "bf16": {"enabled": self.dtype == "bf16"},
            "fp16": {"enabled": False},
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        return _deep_merge(conf, self.ds_overrides)


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices, none on 1-D params (norm weights, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


@runtime_checkable
class _Checkpointable(Protocol):  # a model with a gradient_checkpointing switch (isinstance = hasattr)
    gradient_checkpointing: bool


@runtime_checkable
class _LayerCompilable(Protocol):  # a model that can torch.compile its layers (isinstance = hasattr)
    def compile_layers(self) -> None: ...


ModuleT = TypeVar("ModuleT", bound=nn.Module, covariant=True)


class DSEngine(Protocol[ModuleT]):
    """The part of a `deepspeed.DeepSpeedEngine` the trainer uses (DeepSpeed ships no type information);
    `module` is the wrapped model."""

    @property
    def module(self) -> ModuleT: ...
    optimizer: Any  # a torch optimizer, or DeepSpeed's ZeRO wrapper around one (`.optimizer` chains to it)
    global_rank: int
    device: torch.device
    global_steps: int

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> None: ...
    def gradient_accumulation_steps(self) -> int: ...
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True) -> bool: ...
    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str | None, dict[str, Any] | None]: ...


EngineOrModule: TypeAlias = "DSEngine[nn.Module] | nn.Module"


def build_engine(model: M, cfg: DSConfig) -> DSEngine[M]:
    """Wrap `model` in a DeepSpeed engine with a torch AdamW (and warmup LambdaLR). Build it
    once per run: the optimizer state (Adam moments, step) persists across RL steps. The
    process group is the job's (`trainer.infra.dist.init_process_group`: a launcher's ranks, or one).
    Train with `engine.module.forward_train(...)` (or `engine(...)` for `forward`), then
    `engine.backward(loss)` and `engine.step()` per micro-batch."""
    cfg.validate()
    init_process_group()
    import deepspeed  # after the env: DS_ACCELERATOR is read on first use

    deepspeed.utils.logger.setLevel(logging.WARNING)
    if isinstance(model, _Checkpointable):  # hasattr(model, "gradient_checkpointing")
        model.gradient_checkpointing = cfg.gradient_checkpointing
    if cfg.compile_layers and isinstance(model, _LayerCompilable):  # hasattr(model, "compile_layers")
        model.compile_layers()
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                  betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, fused=True)  # fused: ~10x faster on CPU
    scheduler = None
    if cfg.warmup_steps > 0:
        warm = cfg.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=cfg.to_ds_config(torch.distributed.get_world_size()))
    built: DSEngine[M] = engine
    return built


def build_frozen(model: M, cfg: DSConfig) -> M:
    """A frozen copy for inference (the KL reference) that follows the policy's sharding: under
    ZeRO-3 a DeepSpeed engine without optimizer partitions it over the ranks (its module
    gathers each layer's parameters in forward); otherwise the plain module, full on each rank."""
    model = model.eval().requires_grad_(False)
    init_process_group()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if cfg.zero_stage != 3:
        return model.to(device=get_accelerator().current_device_name(), dtype=DTYPES[cfg.dtype])

    conf = DSConfig(zero_stage=3, dtype=cfg.dtype, grad_accum=cfg.grad_accum).to_ds_config(
        torch.distributed.get_world_size())
    engine, *_ = deepspeed.initialize(model=model, config=conf)
    frozen: M = engine.module.eval()
    return frozen


def unwrap(engine_or_module: DSEngine[M] | M) -> M:
    """The model a DeepSpeed engine wraps, or the model itself."""
    if hasattr(engine_or_module, "zero_optimization_stage"):  # a DeepSpeedEngine (itself an nn.Module)
        return cast("DSEngine[M]", engine_or_module).module
    return cast(M, engine_or_module)


def _is_zero3(engine_or_module: EngineOrModule) -> bool:
    return any(hasattr(p, "ds_id") for p in unwrap(engine_or_module).parameters())  # partitioned


def named_full_params(engine_or_module: EngineOrModule, dtype: torch.dtype | None = None,
                      bucket_numel: int = 1 << 26) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every weight of the engine's module (or of a module,
    e.g. `engine.module`), tied weights once, as CPU-detached copies (optionally cast); a
    fused parameter (q/k/v, gate/up) comes as its checkpoint tensors. Under ZeRO-3 parameters
    are gathered a bucket at a time with `deepspeed.zero.GatheredParameters`: every rank must
    consume the iterator."""
    layout = module_layout(unwrap(engine_or_module))

    def emit(name: str, p: nn.Parameter, parts: Any) -> list[tuple[str, torch.Tensor]]:
        t = p.data.detach()
        t = t.to(dtype) if dtype else t
        return [(n, v.to("cpu", copy=True)) for n, v in split_parts(name, t, parts)]

    if not _is_zero3(engine_or_module):
        for item in layout:
            yield from emit(*item)
        return
    import deepspeed

    bucket: list[tuple[str, nn.Parameter, Any]] = []
    for i, item in enumerate(layout):
        bucket.append(item)
        if sum(_full_numel(q) for _, q, _ in bucket) >= bucket_numel or i == len(layout) - 1:
            with deepspeed.zero.GatheredParameters([q for _, q, _ in bucket], modifier_rank=None):
                out = [pair for n, q, parts in bucket for pair in emit(n, q, parts)]
            bucket = []
            yield from out


def _full_numel(p: nn.Parameter) -> int:
    """A ZeRO-3 parameter's full size (its local tensor is a shard)."""
    return int(cast(ZeroParam, p).ds_numel)


def optimizer_step_count(engine: DSEngine[nn.Module]) -> int:
    """The inner torch optimizer's step counter (max over its param states; 0 before any step)."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return max(steps, default=0)


# ----------------------------------------------------------------------------- RNG + checkpoints
def rng_state() -> dict[str, Any]:
    """JSON-able RNG state of python, numpy and torch (CPU and CUDA)."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple), "numpy's global generator is an MT19937: its legacy state is a tuple"
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    out = {"python": [version, list(state), gauss],
           "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
           "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    def to_bytes(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    version, st, gauss = state["python"]
    random.setstate((version, tuple(st), gauss))
    name, keys, pos, has_gauss, g = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    torch.set_rng_state(to_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([to_bytes(s) for s in state["cuda"]])


def has_checkpoint(ckpt_dir: str | Path) -> bool:
    return (Path(ckpt_dir) / "latest").is_file()


def save_checkpoint(engine: DSEngine[nn.Module], ckpt_dir: str | Path, client_state: dict[str, Any],
                    keep_last: int | None = None) -> str:
    """DeepSpeed checkpoint (module, optimizer, scheduler) under `ckpt_dir/step<N>` (N =
    client_state["step"], else the engine's step count) plus `client_state.json` (rank 0) and
    `rng_rank<r>.json` (every rank). Collective: call it on every rank. Returns the tag;
    `ckpt_dir/latest` names it once everything is written. keep_last: then delete all but the
    newest `keep_last` step folders."""
    json.dumps(client_state)  # fail before writing anything if it is not JSON-able
    tag = f"step{client_state.get('step', engine.global_steps)}"
    rank = engine.global_rank
    tag_dir = Path(ckpt_dir) / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (tag_dir / CLIENT_STATE).write_text(json.dumps(client_state, indent=1))
    (tag_dir / f"rng_rank{rank}.json").write_text(json.dumps(rng_state()))
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={}, save_latest=True)
    if keep_last and rank == 0:
        _prune(Path(ckpt_dir), keep_last, tag)
    return tag


def _prune(ckpt_dir: Path, keep_last: int, current: str) -> None:
    tags = sorted((p for p in ckpt_dir.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                  key=lambda p: int(p.name[4:]))
    for old in tags[:-keep_last]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def read_client_state(ckpt_dir: str | Path, tag: str | None = None) -> dict[str, Any]:
    """The JSON client state of checkpoint `tag` (default: `latest`) without loading anything else."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag or (ckpt_dir / "latest").read_text().strip()
    return json.loads((ckpt_dir / tag / CLIENT_STATE).read_text())


def load_checkpoint(engine: DSEngine[nn.Module], ckpt_dir: str | Path, tag: str | None = None,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Restore module, optimizer and scheduler state from `ckpt_dir` (tag default: `latest`)
    into `engine` (under ZeRO-3 a freshly built one), restore this rank's RNG, and return the
    JSON client state."""
    ckpt_dir = Path(ckpt_dir)
    if tag is None:
        if not has_checkpoint(ckpt_dir):
            raise FileNotFoundError(f"no checkpoint in {ckpt_dir} (missing {ckpt_dir / 'latest'})")
        tag = (ckpt_dir / "latest").read_text().strip()
    load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    rng_file = ckpt_dir / tag / f"rng_rank{engine.global_rank}.json"
    if restore_rng and rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    return json.loads((ckpt_dir / tag / CLIENT_STATE).read_text())


def export_hf(engine: DSEngine[Policy], model_config: SDARConfig | FullAttentionConfig | None, out_dir: str | Path, dtype: str | torch.dtype | None = None,
              source_dir: str | Path | None = None) -> None:
    """Write a Hugging Face folder of the engine's policy that transformers loads like the source
    (`dllm.export.export_pretrained`: source config.json kept, modeling/tokenizer files and
    generation_config.json copied or shipped, dtype = the source's unless `dtype` is given).
    Without `source_dir` the weights keep the engine's dtype. Parameters stream out one
    ZeRO-3 bucket at a time. Collective: every rank iterates; rank 0 writes."""
    model_config = model_config or engine.module.config
    if dtype is None and source_dir is None:  # record the saved weights' dtype in config.json
        dtype = next(engine.module.parameters()).dtype
    named = named_full_params(engine)  # collective under ZeRO-3: every rank gathers
    if engine.global_rank != 0:
        for _ in named:
            pass
        return
    export_pretrained(named, model_config, out_dir, source_dir=source_dir, dtype=dtype)
