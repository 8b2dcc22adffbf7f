"""Inference backends of the engine: `native` (dllm BlockRunner: block-causal; a full-attention folder, LLaDA / Dream, gets
the full-attention runner, server.engine.backends.full_attention, with `cache_mode` exact | prefix) and
`lmdeploy` (an in-process LMDeploy PyTorch engine, CUDA only: lmdeploy_runner.py). Each is imported only
when chosen.

    backend = create_backend("native", model_path, device="auto", dtype="auto", max_batch=16)
    backend = create_backend("lmdeploy", model_path, max_batch=32, strategy="dynamic", threshold=0.9)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.engine.backends.unavailable import BackendUnavailable

if TYPE_CHECKING:
    from server.engine.backends.base import Backend

__all__ = ["BackendUnavailable", "check_backend", "create_backend"]


def check_backend(name: str) -> None:
    """BackendUnavailable (naming server.backend) when `name` cannot run here; cheap, loads no model."""
    if name == "lmdeploy":
        from server.engine.backends.lmdeploy_runner import load_lmdeploy

        load_lmdeploy()


def create_backend(name: str, model_path: str, **kwargs: Any) -> Backend:
    """The runner `name` of `model_path`; `kwargs` (server.cli.build_engine: ServerConfig values of many types)
    go on to that runner's `from_pretrained`, which types each key and refuses the ones it does not take."""
    full: dict[str, Any] = {k: kwargs.pop(k) for k in ("cache_mode", "further_horizon", "ranking", "rng") if k in kwargs}
    if name == "lmdeploy":  # refused there by name unless left default
        kwargs |= full
    if name == "native":  # server.cache_mode / further_horizon / ranking / rng: full-attention models only
        from server.engine.backends.full_attention import (
            FullAttentionRunner,
            check_full_options,
            model_family,
        )

        family = model_family(model_path)
        check_full_options(family, **full)
        if family != "sdar":
            return FullAttentionRunner.from_pretrained(model_path, **full, **kwargs)
        from server.engine.backends.native import NativeBackend

        return NativeBackend.from_pretrained(model_path, **kwargs)
    if name == "lmdeploy":
        from server.engine.backends.lmdeploy_runner import LMDeployRunner

        return LMDeployRunner.from_pretrained(model_path, **kwargs)
    raise BackendUnavailable(f"server.backend: unknown {name!r} (known: native, lmdeploy)")


__all__ = ["Backend", "BackendUnavailable", "check_backend", "create_backend"]
