"""Build modules on the meta device, then give them (uninitialised) storage, at no import cost.

    with on_meta():
        model = SDARForCausalLM(cfg)            # shapes only: no memory, no initialisers run
    model = materialize(model, "cpu", torch.bfloat16)   # storage of the final dtype, allocated once

The obvious way (`with torch.device("meta")` then `.to_empty(device=...)`) makes torch run its Python
references on meta tensors: the first `normal_` imports torch._dynamo, the first `empty_like` of a meta tensor
imports sympy (about 500 modules): 3-6 s of CPU in every process that builds a model (each server's engine,
each trainer rank, each weight loader), for values that are thrown away anyway. `on_meta()` puts torch.nn.init's
initialisers out of action while the modules are built (what `transformers` does in its `no_init_weights`)
and `materialize` allocates each parameter and buffer with `torch.empty` of its shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

INITIALISERS = ("normal_", "uniform_", "trunc_normal_", "constant_", "zeros_", "ones_", "eye_", "dirac_",
                "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
M = TypeVar("M", bound=nn.Module)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside are on the meta device and skip torch.nn.init (it patches the module torch.nn.init
    for the duration, restored on exit or exception; model construction is not concurrent in dlrl)."""
    saved = {name: getattr(nn.init, name) for name in INITIALISERS if hasattr(nn.init, name)}
    try:
        for name in saved:
            setattr(nn.init, name, _keep)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def materialize(module: M, device: str | torch.device, dtype: torch.dtype | None = None) -> M:
    """`module.to(dtype).to_empty(device=device)` without torch's meta-tensor references: each floating
    parameter / buffer becomes `torch.empty` of its shape, of `dtype` (None: its own) on `device`."""

    def fresh(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=kind, device=device)

    return module._apply(fresh)
