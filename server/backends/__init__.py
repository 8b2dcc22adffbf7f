"""Inference backends of the engine: `native` (dllm BlockDecoder) or `lmdeploy` (GPU, lazy).

    backend = create_backend("native", model_path, device="auto", dtype="auto", max_batch=16)
"""

from __future__ import annotations

from typing import Any

from server.backends.base import Backend, BackendUnavailable


def create_backend(name: str, model_path: str, **kwargs: Any) -> Backend:
    if name == "native":
        from server.backends.native import NativeBackend

        return NativeBackend.from_pretrained(model_path, **kwargs)
    if name == "lmdeploy":
        from server.backends.lmdeploy_backend import LMDeployBackend

        return LMDeployBackend(model_path, **kwargs)
    raise BackendUnavailable(f"backend: unknown {name!r} (known: native, lmdeploy)")


__all__ = ["Backend", "BackendUnavailable", "create_backend"]
