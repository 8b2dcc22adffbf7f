"""In-place weight updates of the lmdeploy runner, into LMDeploy's model agent in this process.

    agent = in_process_agent(engine)                  # BackendUnavailable unless LMDeploy's 'uni' executor
    apply_full(host_model, named, lambda ts: push(loop, engine, agent, api, ts, dtype=torch.bfloat16,
                                                  device="cuda", bucket_bytes=256 << 20))

Which path: `Engine.update_params` forwards to `executor.update_params`, and only LMDeploy's Ray executor
implements it (its workers call their model agent's `update_params`, in their own process, with the CUDA-IPC
handles `serialize_state_dict` made in the trainer's). On one GPU LMDeploy builds the 'uni' executor, whose
`update_params` is the base class's NotImplementedError; its model agent lives in this process. dlrl calls
that agent's `update_params` itself -- the call a Ray worker makes -- so the weights go through the same
LMDeploy code (UpdateParamsRequest, `load_format="flattened_bucket"`, FlattenedTensorBucket metadata, the
model's `load_weights` and its post-load processing on `finished`). Only the handle differs: a CUDA-IPC
handle cannot be opened in the process that made it (torch's `rebuild_cuda_tensor` looks its cache up under
another key than `reduce_tensor` stored it, and CUDA refuses to open one's own IPC handle), so the bucket's
flat device tensor is handed over by reference: the payload's `flattened_tensor` is `(take_bucket, (token,
...))` in place of torch's `(rebuild_cuda_tensor, args)`; LMDeploy's deserialiser calls it with `args[6]`
set to its device and gets the tensor back (no copy: `require_clone=False`). The Ray route is not used: its
wheel alone (ray 2.60: 75 MiB) is over the device kit's 64 MiB carry, and it would run a Ray cluster beside
every server for one GPU.

`push` is DiRL's order (OpenMOSS/DiRL train/grpo.py): `engine.sleep(2)` (weights and KV cache released, so
no prefix cache of the old weights survives) -> `engine.wakeup(["weights"])` -> the agent's `update_params`
per FlattenedTensorBucket (one dtype, at most `bucket_bytes`, built on the host and copied to the device
once; the last request `finished=True`) -> `engine.wakeup(["kv_cache"])`, the last in a `finally`: whatever
fails, LMDeploy is awake again when `push` returns or raises (asleep, it cancels every request). Engine
calls run on the runner's loop thread (`loop.run` / `loop.call`).

`apply_full` is the runner's `apply_weights`: a level-2 sleep drops every weight, so an update must carry all
of them (WeightLoadError otherwise, before LMDeploy is touched); once LMDeploy took them, they are copied into
the host copy (`copy_into_model`, the served weights dlrl validates and digests). If LMDeploy fails half-way,
the host copy -- still the served version -- is pushed back the same way and the error raised, so the server
keeps serving (and reporting) the old version; if that fails too, `LMDeployBroken` says LMDeploy holds no
consistent weights (the runner then fails every request until a full push succeeds).
"""

from __future__ import annotations

import base64
import io
import itertools
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

import torch

from server.engine.backends.unavailable import BackendUnavailable

if TYPE_CHECKING:
    from server.engine.backends.lmdeploy_engine import LMDeployAgent, LMDeployAPI, LMDeployEngine

log = logging.getLogger("dlrl.server")
P = ParamSpec("P")
T = TypeVar("T")
Named = list[tuple[str, torch.Tensor]]
ASLEEP = ("weights", "kv_cache")  # what LMDeploy's sleep marks asleep, before anything else


class EngineLoop(Protocol):
    def run(self, coro: Coroutine[object, object, T], timeout: float = ...) -> T: ...

    def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T: ...


class LMDeployBroken(RuntimeError):
    """An update failed and restoring the served weights failed too: LMDeploy's weights are not a version."""


def in_process_agent(engine: LMDeployEngine) -> LMDeployAgent:
    """LMDeploy's model agent of the 'uni' executor (in this process), or BackendUnavailable saying why not."""
    executor = getattr(engine, "executor", None)
    agent = getattr(executor, "model_agent", None)
    if agent is None or not callable(getattr(agent, "update_params", None)):
        raise BackendUnavailable(
            f"server.backend=lmdeploy: LMDeploy built a {type(executor).__name__} executor with no model agent in "
            "this process; dlrl updates weights through the 'uni' executor's (distributed_executor_backend='uni', "
            "one GPU; README: LMDeploy backend)")
    return agent


_handed: dict[int, torch.Tensor] = {}  # token -> a bucket's flat device tensor, until LMDeploy takes it
_handed_lock = threading.Lock()
_tokens = itertools.count(1)


def take_bucket(token: int, *args: object) -> torch.Tensor:
    """Called by LMDeploy's deserialiser in place of torch's `rebuild_cuda_tensor` (`args[5]`: its device)."""
    with _handed_lock:
        t = _handed.pop(token, None)
    if t is None:
        raise RuntimeError(f"lmdeploy weight bucket {token}: not handed over in this process (or taken already)")
    device = args[5] if len(args) > 5 else None
    if isinstance(device, int):  # LMDeploy's torch.cuda.current_device()
        return t.to(torch.device("cuda", device))
    if isinstance(device, (str, torch.device)):
        return t.to(torch.device(device))
    return t


@contextmanager
def handed_over(flat: torch.Tensor, metadata: list[object]) -> Iterator[str]:
    """An UpdateParamsRequest payload (load_format "flattened_bucket") handing `flat` over in this process;
    LMDeploy's format is base64 of a ForkingPickler dump (this process only: no bytes leave it)."""
    token = next(_tokens)
    with _handed_lock:
        _handed[token] = flat
    data = {"flattened_tensor": (take_bucket, (token, None, None, None, None, None, None)), "metadata": metadata,
            "require_clone": False}
    buf = io.BytesIO()
    ForkingPickler(buf).dump(data)
    try:
        yield base64.b64encode(buf.getvalue()).decode("ascii")
    finally:  # LMDeploy failed before taking it: drop our reference
        with _handed_lock:
            _handed.pop(token, None)


def buckets(named: Named, dtype: torch.dtype, bucket_bytes: int) -> Iterator[Named]:
    """The tensors in `dtype`, at most `bucket_bytes` per bucket (one tensor at least)."""
    bucket: Named = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * dtype.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t.to(dtype)))
        size += nbytes
    if bucket:
        yield bucket


def push(loop: EngineLoop, engine: LMDeployEngine, agent: LMDeployAgent, api: LMDeployAPI, named: Named, *,
         dtype: torch.dtype, device: str,
         bucket_bytes: int) -> int:
    """sleep(2) -> wakeup weights -> the agent's update_params per bucket -> wakeup (always); the buckets sent."""
    asleep = list(ASLEEP)
    done = False
    try:
        loop.run(engine.sleep(2))
        loop.call(engine.wakeup, ["weights"])
        asleep.remove("weights")
        parts = list(buckets(named, dtype, bucket_bytes))
        for i, bucket in enumerate(parts):
            packed = api.flattened_bucket(named_tensors=bucket)  # on the host: one copy to the device
            with handed_over(packed.get_flattened_tensor().to(device), packed.get_metadata()) as payload:
                request = api.update_request(serialized_named_tensors=payload, load_format="flattened_bucket",
                                             finished=i == len(parts) - 1)
                loop.call(agent.update_params, request)
        done = True
        return len(parts)
    finally:
        try:
            loop.call(engine.wakeup, asleep)
        except Exception as e:
            if done:
                raise
            log.error("lmdeploy: waking %s after a failed update failed too: %r", asleep, e)


def apply_full(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], push_fn: Callable[[Named], object],
               ) -> None:
    """Every tensor -> LMDeploy (`push_fn`), then the host copy `model`; on failure the host copy is pushed back."""
    from dllm.weights import WeightLoadError, copy_into_model, hf_tensors

    named = list(named)
    missing = {n for n, _ in hf_tensors(model)} - {n for n, _ in named}
    if missing:  # level-2 sleep drops every weight: a partial push would serve garbage
        raise WeightLoadError(f"lmdeploy backend: an update must carry every tensor; missing "
                              f"{sorted(missing)[0]!r} ({len(missing)} in all)")
    try:
        push_fn(named)
    except Exception as e:
        log.error("lmdeploy weight update failed (%r): pushing the served weights back", e)
        try:
            push_fn(list(hf_tensors(model)))
        except Exception as again:
            raise LMDeployBroken(f"lmdeploy weight update failed ({e}) and restoring the served weights failed "
                                 f"too ({again}): restart the server, or push a full update") from e
        raise
    copy_into_model(model, named, strict=True)
