"""Inference backends of the engine: `native` (dllm BlockDecoder; a full-attention folder, LLaDA / Dream, gets
the full-attention runner, server.engine.backends.full_attention, with `cache_mode` exact | prefix). The `Backend` interface is
where another engine plugs in (an LMDeploy adapter needs a GPU to be built and tested: see the
README's GPU notes).

    backend = create_backend("native", model_path, device="auto", dtype="auto", max_batch=16)
"""

from __future__ import annotations

from typing import Any

from server.engine.backends.base import Backend, BackendUnavailable


def create_backend(name: str, model_path: str, **kwargs: Any) -> Backend:
    cache_mode = kwargs.pop("cache_mode", "exact")  # server.cache_mode: full-attention models only
    if name == "native":
        from server.engine.backends.full_attention import FullAttentionRunner, check_cache_mode, model_family

        family = model_family(model_path)
        check_cache_mode(family, cache_mode)
        if family != "sdar":
            return FullAttentionRunner.from_pretrained(model_path, cache_mode=cache_mode, **kwargs)
        from server.engine.backends.native import NativeBackend

        return NativeBackend.from_pretrained(model_path, **kwargs)
    raise BackendUnavailable(f"backend: unknown {name!r} (known: native)")


__all__ = ["Backend", "BackendUnavailable", "create_backend"]
