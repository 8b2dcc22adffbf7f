"""Where the sender's tensors come from: plain (name, tensor) pairs, or ZeRO-3 gathered params.

    push(servers, model.hf_named_tensors(), version)                   # plain module / dict
    push(servers, iter_deepspeed_params(engine), version)              # DeepSpeed ZeRO-3, rank 0
    drain(iter_deepspeed_params(engine))                               # ... every other rank

A source is either an iterable of pairs (materialised once: references, no copy) or a
callable returning a fresh iterator each call. A callable may also have
`specs(dtype) -> [(name, dtype, shape)]`; without it the sender calls it once more just to
read the shapes. The iterator must yield the same names in the same order every call.

`iter_deepspeed_params` gathers ZeRO-3 partitions group by group (`gather_bytes` at a
time) with `deepspeed.zero.GatheredParameters`: a collective, so every trainer rank must
iterate the source (rank 0 inside `push`, the others via `drain`). Each yielded tensor is
only valid until the generator resumes; the packer copies it into a bucket at once.
Names are the checkpoint's: a module with `hf_layout()` (dllm's SDARForCausalLM: fused
q/k/v and gate/up parameters) has each fused parameter gathered once and sent as its
row slices under the HF names (`module_layout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, cast

import torch

from weight_sync.bucket import Spec, spec_of
from weight_sync.manifest import dtype_name

Pairs = Iterable[tuple[str, torch.Tensor]]


class Source:
    """Normalised source: specs (name, dtype, shape as sent), a fresh iterator, a device."""

    def __init__(self, specs: list[Spec], make_iter: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                 device: torch.device):
        self.specs, self.make_iter, self.device = specs, make_iter, device


def as_source(named: Pairs | dict[str, torch.Tensor] | Callable[[], Pairs], dtype: torch.dtype | None) -> Source:
    if callable(named) and not isinstance(named, dict):
        make = named
        if hasattr(named, "specs"):
            specs, device = named.specs(dtype), getattr(named, "device", torch.device("cpu"))
        else:
            pairs = [(n, t) for n, t in make()]  # one extra pass, only to read names and shapes
            specs = [spec_of(n, t, dtype) for n, t in pairs]
            device = pairs[0][1].device if pairs else torch.device("cpu")
            del pairs
        return Source(specs, lambda: iter(make()), torch.device(device))
    items = list(named.items()) if isinstance(named, dict) else list(named)
    device = items[0][1].device if items else torch.device("cpu")
    return Source([spec_of(n, t, dtype) for n, t in items], lambda: iter(items), device)


Parts = list[tuple[str, int, int]] | None  # [(HF name, first row, end row)] of a fused parameter


def module_layout(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, Parts]]:
    """[(parameter name, parameter, parts)]: the module's `hf_layout()` when it has one (fused
    parameters that stand for several checkpoint tensors), else its parameters one to one."""
    fn = getattr(module, "hf_layout", None)
    return fn() if fn is not None else [(n, p, None) for n, p in module.named_parameters()]


def split_parts(name: str, t: torch.Tensor, parts: Parts) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of one (full) parameter: itself, or its row slices (views)."""
    if parts is None:
        yield name, t
        return
    for hf_name, a, b in parts:
        yield hf_name, t[a:b]


class ZeroParam(Protocol):
    """What DeepSpeed's ZeRO-3 sets on a partitioned parameter (its local tensor is a shard), unknown to torch's
    stubs: `hasattr(p, "ds_id")` tells a partitioned one."""

    ds_id: int
    ds_shape: torch.Size  # the full parameter's shape
    ds_numel: int  # and its size


class DeepSpeedParams:
    """Callable source over a (possibly ZeRO-3 partitioned) module's parameters."""

    def __init__(self, engine: Any, gather_bytes: int = 256 << 20):
        self.module = getattr(engine, "module", engine)
        self.gather_bytes = gather_bytes
        first = next(self.module.parameters())
        self.device = first.device

    @staticmethod
    def _shape(p: torch.Tensor) -> tuple[int, ...]:
        return tuple(cast(ZeroParam, p).ds_shape) if hasattr(p, "ds_id") else tuple(p.shape)

    def specs(self, dtype: torch.dtype | None = None) -> list[Spec]:
        out = []
        for name, p, parts in module_layout(self.module):
            send = dtype_name(dtype if dtype is not None and p.is_floating_point() else p.dtype)
            shape = self._shape(p)
            rows = [(name, 0, shape[0] if shape else 0)] if parts is None else parts
            for hf_name, a, b in rows:
                out.append((hf_name, send, shape if parts is None else (b - a, *shape[1:])))
        return out

    def _groups(self) -> Iterator[list[tuple[str, torch.Tensor, Parts]]]:
        group: list[tuple[str, torch.Tensor, Parts]] = []
        size = 0
        for name, p, parts in module_layout(self.module):
            numel = 1
            for s in self._shape(p):
                numel *= s
            if group and size + numel * p.element_size() > self.gather_bytes:
                yield group
                group, size = [], 0
            group.append((name, p, parts))
            size += numel * p.element_size()
        if group:
            yield group

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group in self._groups():
            partitioned = [p for _, p, _ in group if hasattr(p, "ds_id")]
            if partitioned:
                import deepspeed  # lazy: only trainers running ZeRO-3 have it loaded

                ctx = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                for name, p, parts in group:
                    yield from split_parts(name, p.data, parts)  # full tensor, valid inside the gather only


def iter_deepspeed_params(engine: Any, gather_bytes: int = 256 << 20) -> DeepSpeedParams:
    """Source for `push` from a DeepSpeed engine (ZeRO-0..3) or a plain module."""
    return DeepSpeedParams(engine, gather_bytes)


def drain(source: Callable[[], Pairs]) -> None:
    """Iterate a gathering source without sending (the other ranks of a ZeRO-3 job)."""
    for _ in source():
        pass
