"""weight_sync: push trainer weights into running servers in place (torch + stdlib only).

    from weight_sync import push, weights_digest
    push(["http://127.0.0.1:8000"], model.named_parameters(), version=1, transport="shm", token=tok)
    assert weights_digest(model.named_parameters()) == GET /weights/checksum

Files: manifest.py (JSON manifest, checksums, digest), bucket.py (pack/unpack),
sender.py (trainer side), sources.py (plain / ZeRO-3 params), receiver.py (server side)
+ staging.py (one staged update), errors.py (errors with HTTP statuses),
transports/{shm,dist,http}.py (data planes). Imports neither server, trainer nor dllm.
"""

from weight_sync.errors import ManifestError, UpdateConflict, UpdateFailed, WeightSyncError
from weight_sync.manifest import Manifest, weights_digest
from weight_sync.receiver import WeightReceiver
from weight_sync.sender import WeightSender, close_all, push
from weight_sync.sources import drain, iter_deepspeed_params

__all__ = [
    "Manifest", "ManifestError", "UpdateConflict", "UpdateFailed", "WeightReceiver", "WeightSender",
    "WeightSyncError", "close_all", "drain", "iter_deepspeed_params", "push", "weights_digest",
]
