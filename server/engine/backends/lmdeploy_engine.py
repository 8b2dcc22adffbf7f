"""LMDeploy as the lmdeploy runner meets it: the lazy import and its checks, the API handles, the loop thread.

    lmdeploy = load_lmdeploy()          # BackendUnavailable naming server.backend: missing, too old, no CUDA
    check_options(device="cuda", kv_cache_memory=0, compile=False)   # ConfigError for native-only keys
    api = lmdeploy_api()                # GenerationConfig, UpdateParamsRequest, FlattenedTensorBucket
    loop = LoopThread()                 # LMDeploy's engine loop and the consumers run on it
    loop.call(engine.start_loop); loop.run(engine.sleep(2)); loop.close()

Nothing here imports lmdeploy at module import: `load_lmdeploy` and `lmdeploy_api` do, when the backend
starts (lmdeploy is a CUDA-only optional extra: `pip install 'dlrl[lmdeploy]'`). Tests inject an
`LMDeployAPI` of stand-ins (tests/server/lmdeploy_double.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from types import ModuleType
from typing import ParamSpec, Protocol, TypeVar

import torch

from server.engine.backends.unavailable import BackendUnavailable

log = logging.getLogger("dlrl.server")
P = ParamSpec("P")
T = TypeVar("T")
CALL_TIMEOUT_S = 600.0  # an engine call (sleep, update, wakeup) that takes longer is a failure
MIN_VERSION = (0, 13)  # async Engine.sleep, requests cancelled while asleep (read against 0.13 - 0.18)
TESTED_BELOW = (0, 19)  # the in-process update path was read against 0.18's source: newer ones get a warning


# lmdeploy ships no type information: what dlrl calls of it, as Protocols (read against its 0.13 - 0.18 source)
class LMDeployOutput(Protocol):
    status: object        # lmdeploy.messages.ResponseType (its `.name` is read)
    token_ids: list[int]  # the tokens this output adds


class LMDeployInstance(Protocol):
    """One generation slot of the engine (`Engine.create_instance()`)."""

    def async_stream_infer(self, session_id: int, input_ids: list[int], *,
                           gen_config: object) -> AsyncIterator[LMDeployOutput]: ...

    async def async_cancel(self, session_id: int) -> object: ...


class LMDeployEngine(Protocol):
    """lmdeploy.pytorch.engine.Engine: instances, sleep / wakeup around a weight update, shutdown."""

    def create_instance(self) -> LMDeployInstance: ...

    async def sleep(self, level: int) -> object: ...

    def wakeup(self, tags: list[str]) -> object: ...

    def close(self) -> object: ...

    async def wait_tasks(self) -> object: ...


class LMDeployAgent(Protocol):
    """The 'uni' executor's model agent (in this process): where a weight update loads."""

    def update_params(self, request: object) -> object: ...


class FlattenedBucket(Protocol):
    """lmdeploy.utils.FlattenedTensorBucket: a bucket's tensors as one flat tensor and its metadata."""

    def get_flattened_tensor(self) -> torch.Tensor: ...

    def get_metadata(self) -> list[object]: ...


@dataclass
class LMDeployAPI:
    """What the runner calls of lmdeploy besides the engine (injected by tests)."""

    generation_config: Callable[..., object]  # lmdeploy.GenerationConfig
    update_request: Callable[..., object]     # lmdeploy.serve.openai.protocol.UpdateParamsRequest
    flattened_bucket: Callable[..., FlattenedBucket]  # lmdeploy.utils.FlattenedTensorBucket(named_tensors=...)


def load_lmdeploy() -> ModuleType:
    """The lmdeploy module, or BackendUnavailable naming server.backend (missing package, no CUDA)."""
    try:
        import lmdeploy
    except ImportError as e:
        raise BackendUnavailable(
            f"server.backend=lmdeploy: the lmdeploy package is not installed ({e}); install it in its own "
            "environment: pip install 'dlrl[lmdeploy]' (README: LMDeploy backend)") from None
    version = tuple(int(x) for x in re.findall(r"\d+", lmdeploy.__version__)[:2])
    if version < MIN_VERSION:
        raise BackendUnavailable(f"server.backend=lmdeploy: lmdeploy {lmdeploy.__version__} is too old; the backend "
                                 f"needs >= {'.'.join(map(str, MIN_VERSION))}: pip install 'dlrl[lmdeploy]'")
    if version >= TESTED_BELOW:
        log.warning("lmdeploy %s is newer than the versions server.backend=lmdeploy was checked against (< %s): "
                    "its weight-update path may have changed", lmdeploy.__version__, ".".join(map(str, TESTED_BELOW)))
    if not torch.cuda.is_available():
        raise BackendUnavailable("server.backend=lmdeploy: LMDeploy's PyTorch engine needs a CUDA device and none "
                                 "is visible; use server.backend=native on CPU")
    return lmdeploy


FULL_ATTENTION_DEFAULTS = {"cache_mode": "exact", "further_horizon": -1, "ranking": "official", "rng": "counter"}


def check_options(*, device: str, kv_cache_memory: int, compile: bool, kv_admission: str = "reserve",
                  **full_attention: object) -> None:
    """ConfigError naming the server key for native-only options (they would do nothing here), the
    full-attention decoding keys (`cache_mode`, `further_horizon`, `ranking`, `rng`) included."""
    from dlrl_config import ConfigError

    for key, value in full_attention.items():
        if value != FULL_ATTENTION_DEFAULTS[key]:
            raise ConfigError(f"server.{key}: the native full-attention runner's (LLaDA / Dream); the lmdeploy "
                              f"backend serves SDAR / TraDo with LMDeploy's own cache (set server.{key}="
                              f"{FULL_ATTENTION_DEFAULTS[key]} or server.backend=native)")

    if device not in ("", "auto") and not device.startswith("cuda"):
        raise ConfigError(f"server.device: the lmdeploy backend runs on CUDA only, got {device!r}")
    if kv_cache_memory:
        raise ConfigError("server.kv_cache_memory: LMDeploy sizes its KV cache as a share of free memory; set "
                          "server.kv_cache_fraction instead (0 here)")
    if compile:
        raise ConfigError("server.compile: the lmdeploy backend runs LMDeploy's own kernels (server.cuda_graphs "
                          "turns its CUDA graphs on); set server.compile=false")
    if kv_admission != "reserve":
        raise ConfigError("server.kv_admission: LMDeploy admits and preempts by its own scheduler; set "
                          "server.kv_admission=reserve")


def lmdeploy_api() -> LMDeployAPI:
    from lmdeploy import GenerationConfig
    from lmdeploy.serve.openai.protocol import UpdateParamsRequest
    from lmdeploy.utils import FlattenedTensorBucket

    return LMDeployAPI(GenerationConfig, UpdateParamsRequest, FlattenedTensorBucket)


class LoopThread:
    """An asyncio loop in a daemon thread: LMDeploy's engine loop and the sequences' consumers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dlrl-lmdeploy", daemon=True)
        self.thread.start()

    def spawn(self, coro: Coroutine[object, object, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[object, object, T], timeout: float = CALL_TIMEOUT_S) -> T:
        return self.spawn(coro).result(timeout)

    def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on the loop's thread (LMDeploy's engine state belongs to it)."""

        async def call() -> T:
            return fn(*args, **kwargs)

        return self.run(call())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5.0)
        if not self.thread.is_alive():
            self.loop.close()
