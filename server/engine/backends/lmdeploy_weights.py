"""In-place weight updates of the lmdeploy runner, with LMDeploy's own update path (in-process).

    apply_full(host_model, named, lambda ts: push(loop, engine, api, ts, dtype=torch.bfloat16, device="cuda",
                                                  bucket_bytes=256 << 20))

`push` is DiRL's order (OpenMOSS/DiRL train/grpo.py): `engine.sleep(2)` (weights and KV cache released,
so no prefix cache of the old weights survives) -> `engine.wakeup(["weights"])` -> `engine.update_params`
per FlattenedTensorBucket (one dtype, at most `bucket_bytes`, serialized as LMDeploy's `serialize_state_dict`
does: CUDA IPC handles, resolved in this same process; the last request `finished=True`) ->
`engine.wakeup(["kv_cache"])`. Engine calls run on the runner's loop thread (`loop.run` / `loop.call`).

`apply_full` is the runner's `apply_weights`: a level-2 sleep drops every weight, so an update must carry
all of them (WeightLoadError otherwise, before LMDeploy is touched); once LMDeploy took them, they are
copied into the host copy (`copy_into_model`, the served weights dlrl validates and digests). If LMDeploy
fails half-way, the host copy -- still the served version -- is pushed back the same way and the error
raised, so the server keeps serving (and reporting) the old version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, Protocol

import torch

log = logging.getLogger("dlrl.server")
Named = list[tuple[str, torch.Tensor]]


class EngineLoop(Protocol):
    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = ...) -> Any: ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...


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


def push(loop: EngineLoop, engine: Any, api: Any, named: Named, *, dtype: torch.dtype, device: str,
         bucket_bytes: int) -> int:
    """sleep(2) -> wakeup weights -> update_params per bucket -> wakeup kv_cache; returns the buckets sent."""
    loop.run(engine.sleep(2))
    loop.call(engine.wakeup, ["weights"])
    parts = list(buckets(named, dtype, bucket_bytes))
    for i, bucket in enumerate(parts):
        payload = api.serialize_bucket([(n, t.to(device)) for n, t in bucket])
        request = api.update_request(serialized_named_tensors=payload, load_format="flattened_bucket",
                                     finished=i == len(parts) - 1)
        loop.call(engine.update_params, request)
    loop.call(engine.wakeup, ["kv_cache"])
    return len(parts)


def apply_full(model: Any, named: Iterable[tuple[str, torch.Tensor]], push_fn: Callable[[Named], Any]) -> None:
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
            raise RuntimeError(f"lmdeploy weight update failed ({e}) and restoring the served weights failed "
                               f"too ({again}): restart the server") from e
        raise
    copy_into_model(model, named, strict=True)
