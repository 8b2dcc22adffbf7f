"""weight_sync: push trainer weights into running servers in place (torch + xxhash + pydantic only).

    from weight_sync import WeightSender, push, weights_digest
    with WeightSender(["http://127.0.0.1:8000"], transport="shm", token=tok, run_id="run-1") as sender:
        sender.connect(model.hf_named_tensors())       # once, at startup
        sender.push(model.hf_named_tensors(), version=1)
    push(["http://127.0.0.1:8000"], model.hf_named_tensors(), version=2, token=tok)   # a one-off push
    assert weights_digest(model.hf_named_tensors()) == GET /weights/checksum

Files: protocol.py (control-plane wire schemas, shared with the server), manifest.py
(JSON manifest, digest), checksum.py (xxh3, fused copy+hash, NaN scan), devhash.py (mlh64:
a checksum and NaN scan computed on the bytes' device, for cuda_ipc), bucket.py
(pack/unpack), sender.py + control.py (trainer side), sources.py (plain / ZeRO-3 params),
receiver.py + staging.py (server side), errors.py (errors with HTTP statuses),
transports/{shm,dist,http,cuda_ipc}.py (data planes). Imports neither server, trainer nor dllm.
"""

import importlib
from typing import TYPE_CHECKING, Any

# name -> its module; imported on first use (PEP 562), so `weight_sync.protocol` (the wire schemas,
# torch-free) is read without torch: `dlrl ... --help` and `--check` never import torch
_EXPORTS = {
    **dict.fromkeys(("ManifestError", "NonFiniteWeights", "NotOwner", "ServerRestarted", "UpdateConflict",
                     "UpdateFailed", "WeightSyncError"), "weight_sync.errors"),
    "Manifest": "weight_sync.manifest", "weights_digest": "weight_sync.manifest",
    "WeightReceiver": "weight_sync.receiver", "WeightSender": "weight_sync.sender", "push": "weight_sync.sender",
    "drain": "weight_sync.sources", "iter_deepspeed_params": "weight_sync.sources",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from weight_sync.errors import (
        ManifestError as ManifestError,
    )
    from weight_sync.errors import (
        NonFiniteWeights as NonFiniteWeights,
    )
    from weight_sync.errors import (
        NotOwner as NotOwner,
    )
    from weight_sync.errors import (
        ServerRestarted as ServerRestarted,
    )
    from weight_sync.errors import (
        UpdateConflict as UpdateConflict,
    )
    from weight_sync.errors import (
        UpdateFailed as UpdateFailed,
    )
    from weight_sync.errors import (
        WeightSyncError as WeightSyncError,
    )
    from weight_sync.manifest import Manifest as Manifest
    from weight_sync.manifest import weights_digest as weights_digest
    from weight_sync.receiver import WeightReceiver as WeightReceiver
    from weight_sync.sender import WeightSender as WeightSender
    from weight_sync.sender import push as push
    from weight_sync.sources import drain as drain
    from weight_sync.sources import iter_deepspeed_params as iter_deepspeed_params


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
