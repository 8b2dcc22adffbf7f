"""LMDeploy backend (placeholder for GPU serving of SDAR via LMDeploy's PyTorch engine).

LMDeploy can serve SDAR block-diffusion checkpoints on CUDA. This module is where an
adapter to the `Backend` interface goes; it imports lmdeploy lazily and refuses to start
with a clear message on CPU-only machines or when lmdeploy is not installed
(`pip install 'dlrl[gpu]'`). Until the adapter exists, use `backend: native`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from server.backends.base import Backend, BackendUnavailable


def check_available() -> None:
    """Raise BackendUnavailable naming what is missing for the LMDeploy backend."""
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable("backend 'lmdeploy' needs a CUDA GPU; this machine has none "
                                 "(use server.backend=native, which runs on CPU)")
    if importlib.util.find_spec("lmdeploy") is None:
        raise BackendUnavailable("backend 'lmdeploy' needs the lmdeploy package: "
                                 "pip install 'dlrl[gpu]' (or use server.backend=native)")


class LMDeployBackend(Backend):
    name = "lmdeploy"

    def __init__(self, model_path: str, **kwargs: Any):
        check_available()
        import lmdeploy  # noqa: F401  (lazy: only on GPU hosts)

        raise BackendUnavailable(
            "backend 'lmdeploy': the adapter (traces with per-token steps/logprobs, in-place "
            "weight updates) is not implemented yet; use server.backend=native")

    def new_sequence(self, prompt_ids, params):  # pragma: no cover - never constructed
        raise NotImplementedError

    def add(self, seqs):  # pragma: no cover
        raise NotImplementedError

    def step(self, seqs):  # pragma: no cover
        raise NotImplementedError

    def release(self, seq):  # pragma: no cover
        raise NotImplementedError

    @property
    def num_free_slots(self) -> int:  # pragma: no cover
        return 0
