"""Seeded random named tensors: the tiny "models" that the weight-sync tests push, pack, check and serve.

    random_tensors({"w": ((64, 16), torch.float32), "b": ((16,), torch.bfloat16)}, seed=3)
    tiny_model(seed)   # the transports' model (fp32 + bf16); the sender subprocesses import it too

Each tensor is drawn in the spec's order from one generator seeded with `seed` (fp32 normal draws, then cast),
so a seed names the same tensors in the test and in a sender subprocess.
"""

from __future__ import annotations

import torch

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]

TINY_MODEL: Spec = {
    "embed.weight": ((64, 32), torch.float32),
    "layers.0.weight": ((32, 32), torch.bfloat16),
    "layers.0.bias": ((32,), torch.bfloat16),
    "norm.weight": ((32,), torch.float32),
    "norm.bias": ((32,), torch.float32),
}


def random_tensors(spec: Spec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in spec.items()}


def tiny_model(seed: int) -> dict[str, torch.Tensor]:
    return random_tensors(TINY_MODEL, seed)
