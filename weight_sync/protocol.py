"""Wire schemas of the weight-sync control plane (pydantic), shared by server and sender.

    body = BeginRequest(version=3, transport="shm", manifest=m.to_dict(), run_id="tiny-rl")
    client.post("/weights/begin", json=body.model_dump())          # weight_sync/sender.py
    async def begin(body: BeginRequest) -> BeginResponse: ...       # server/api/routes_weights.py

Ownership: every request about an update names its run (`run_id`; the http data plane's
X-Weights-Run-Id header); only the run that began an update may send its buckets, commit or
abort it: another run gets 409 naming the owner, and nothing changes (docs/SECURITY.md).

Endpoints (admin bearer token):
    POST /weights/connect        ConnectRequest -> ConnectResponse   (size region / staging, join dist group)
    POST /weights/begin          BeginRequest   -> BeginResponse
    PUT  /weights/bucket/{i}     raw bytes (http data plane; headers in weight_sync/transports/http.py)
    POST /weights/commit         CommitRequest  -> CommitResponse    (state "applied" | "pending")
    POST /weights/abort          AbortRequest   -> AbortResponse
    GET  /weights/version        -> VersionResponse
    GET  /weights/updates/{v}    -> UpdateState   (what became of version v: commit is queryable)
    GET  /weights/checksum       -> ChecksumResponse
    POST /weights/rollback       RollbackRequest -> RollbackResponse (restore a kept version; 404 not kept)
    GET  /weights/kept           -> KeptResponse  (versions held in host memory for rollback)
The manifest itself is validated by weight_sync.manifest.Manifest (field-naming errors).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Transport = Literal["shm", "dist", "http", "cuda_ipc"]
RUN_ID_PATTERN = r"^[A-Za-z0-9._:@/+-]*$"  # run_id: names the pushing run ("" = the anonymous run)
RUN_ID_MAX_LENGTH = 128


class UpdatePhase(StrEnum):
    """Where an update stands (weight_sync/receiver.py's state machine); the values are the wire strings.

    In progress: receiving -> verifying -> verified -> draining -> applying; outcomes: applied,
    failed; unknown: a version this server never saw (or forgot).
    """

    RECEIVING = "receiving"
    VERIFYING = "verifying"
    VERIFIED = "verified"
    DRAINING = "draining"
    APPLYING = "applying"
    APPLIED = "applied"
    FAILED = "failed"
    UNKNOWN = "unknown"


Checksum = Annotated[int, Field(ge=0, lt=1 << 64)]  # the manifest's checksum_algo: xxh3_64 | mlh64


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConnectRequest(_Request):
    """Prepare the data plane once (shm attach, staging buffers, dist group) before the first begin."""

    transport: Transport
    manifest: dict[str, Any]
    options: dict[str, Any] = Field(default_factory=dict)
    run_id: str = Field(default="", max_length=RUN_ID_MAX_LENGTH, pattern=RUN_ID_PATTERN)


class ConnectResponse(BaseModel):
    transport: Transport
    num_buckets: int
    total_bytes: int
    staging_bytes: int


class BeginRequest(_Request):
    version: int = Field(ge=1)
    transport: Transport
    manifest: dict[str, Any]
    options: dict[str, Any] = Field(default_factory=dict)
    run_id: str = Field(default="", max_length=RUN_ID_MAX_LENGTH, pattern=RUN_ID_PATTERN)
    lease_s: float | None = Field(default=None, gt=0, le=3600)  # None: the server's weight_sync_lease_s


class BeginResponse(BaseModel):
    version: int
    transport: Transport
    num_buckets: int
    total_bytes: int
    run_id: str
    lease_s: float
    took_over: int | None = None  # version of the same run's update this begin replaced


class BucketResponse(BaseModel):
    index: int   # the bucket
    nbytes: int  # bytes received (0: the body failed half-way and the bucket was released)


class CommitRequest(_Request):
    version: int = Field(ge=1)
    checksums: list[Checksum | None] | None = Field(default=None, max_length=1 << 20)
    abort_inflight: bool | None = None  # None: the server's weight_sync_abort_inflight
    run_id: str = Field(default="", max_length=RUN_ID_MAX_LENGTH, pattern=RUN_ID_PATTERN)


class CommitResponse(BaseModel):
    version: int  # the committed version
    state: Literal["applied", "pending"]  # pending: draining in-flight sequences; poll /weights/updates/{v}
    served_version: int


class AbortRequest(_Request):
    version: int | None = None
    reason: str = Field(default="aborted by the sender", max_length=1000)
    run_id: str = Field(default="", max_length=RUN_ID_MAX_LENGTH, pattern=RUN_ID_PATTERN)  # must own it


class AbortResponse(BaseModel):
    aborted: bool
    version: int


class UpdateInfo(BaseModel):
    version: int
    transport: Transport
    phase: UpdatePhase  # one of the in-progress phases
    run_id: str
    buckets_received: int
    num_buckets: int
    lease_left_s: float


class VersionResponse(BaseModel):
    version: int
    update: UpdateInfo | None
    last_failure: str
    is_paused: bool = False
    dtype: str | None = None  # the served floating dtype (what dtype="auto" sends)


class UpdateState(BaseModel):
    version: int
    state: UpdatePhase
    reason: str = ""
    run_id: str = ""
    served_version: int


class ChecksumResponse(BaseModel):
    version: int
    digest: str


class RollbackRequest(_Request):
    """Restore a version the server kept in host memory (server.keep_versions); no trainer involved."""

    version: int = Field(ge=0, lt=1 << 53)
    abort_inflight: bool | None = None  # None: the server's weight_sync_abort_inflight


class RollbackResponse(BaseModel):
    version: int           # the served version now
    previous_version: int  # the version served before
    digest: str            # weights_digest of the restored weights (= GET /weights/checksum)
    seconds: float         # pause + restore


class KeptResponse(BaseModel):
    versions: list[int]    # kept versions, least recently served first
    served_version: int
    keep: int              # server.keep_versions
    num_bytes: int         # host memory they hold
