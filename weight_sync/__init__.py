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

from weight_sync.errors import (
    ManifestError,
    NonFiniteWeights,
    NotOwner,
    ServerRestarted,
    UpdateConflict,
    UpdateFailed,
    WeightSyncError,
)
from weight_sync.manifest import Manifest, weights_digest
from weight_sync.receiver import WeightReceiver
from weight_sync.sender import WeightSender, push
from weight_sync.sources import drain, iter_deepspeed_params

__all__ = [
    "Manifest", "ManifestError", "NonFiniteWeights", "NotOwner", "ServerRestarted", "UpdateConflict", "UpdateFailed", "WeightReceiver",
    "WeightSender", "WeightSyncError", "drain", "iter_deepspeed_params", "push",
    "weights_digest",
]
