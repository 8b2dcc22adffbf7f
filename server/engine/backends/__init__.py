"""Inference backends of the engine: `native` (dllm BlockDecoder). The `Backend` interface is
where another engine plugs in (an LMDeploy adapter needs a GPU to be built and tested: see the
README's GPU notes).

    backend = create_backend("native", model_path, device="auto", dtype="auto", max_batch=16)
"""

from __future__ import annotations

from typing import Any

from server.engine.backends.base import Backend, BackendUnavailable


def create_backend(name: str, model_path: str, **kwargs: Any) -> Backend:
    if name == "native":
        from server.engine.backends.native import NativeBackend

        return NativeBackend.from_pretrained(model_path, **kwargs)
    raise BackendUnavailable(f"backend: unknown {name!r} (known: native)")


__all__ = ["Backend", "BackendUnavailable", "create_backend"]
