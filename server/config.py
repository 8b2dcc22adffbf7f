"""ServerConfig: the `server` section of a dlrl YAML config (plus `key=value` overrides).

    cfg = load_server_config("configs/tiny.yaml", ["server.port=8001", "max_batch=8"])

`model=""` serves the embedded tiny default (`dllm.tiny.ensure_default_model`, trained on
first use). `admin_token=""` falls back to the `DLRL_ADMIN_TOKEN` env var; with neither,
admin endpoints are disabled. `max_model_len=0` means min(max_position_embeddings, 8192).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from dllm.configlib import ConfigError, load_section

BACKENDS = ("native", "lmdeploy")
RECORD_MODES = ("none", "sample", "all")
FEEDBACK_ENV_VAR = "DLRL_FEEDBACK_TOKEN"
STRATEGIES = ("static", "dynamic", "sequential")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = ""                  # HF-style folder; "" = embedded tiny default
    served_model_name: str = ""      # name in /v1/models; "" = the folder name
    backend: str = "native"
    device: str = "auto"             # auto | cpu | cuda | cuda:N
    dtype: str = "auto"              # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    max_batch: int = 16              # max concurrently decoded sequences (KV-cache slots)
    max_queue: int = 256             # max waiting sequences before 429
    max_model_len: int = 0           # prompt + completion limit; 0 = min(max_position_embeddings, 8192)
    trust_remote_code: bool = False  # run the model folder's own Python code (tokenizer/config); never asked
    block_size: int = 0              # 0 = config.json's; set it for folders that lack it (or to decode with another)
    mask_token_id: int = -1          # -1 = config.json's, else the tokenizer's <|MASK|>
    admin_token: str = ""
    admin_token_file: str = ""       # read (or create) the token here when none is set otherwise
    log_level: str = "info"
    max_body_bytes: int = 4 << 20    # request bodies over this are a 413 before being read (weights exempt)
    shutdown_timeout: float = 20.0   # SIGTERM: seconds in-flight requests get before they are aborted
    # defaults for requests that leave these unset
    default_max_tokens: int = 64
    default_strategy: str = "dynamic"
    default_threshold: float = 0.9
    default_temperature: float = 1.0
    # weight sync (server side of weight_sync; see server/weight_updates.py)
    weight_sync_lease_s: float = 30.0          # an update with no data-plane progress for this long is aborted
    weight_sync_drain_timeout_s: float = 30.0  # commit waits this long for in-flight sequences, then...
    weight_sync_abort_inflight: bool = False   # ... aborts them (true) or lets them finish on the old weights
    weight_sync_check_finite: bool = True      # refuse updates holding NaN/inf (400), nothing applied
    keep_versions: int = 2           # weight versions kept in host memory for POST /weights/rollback (0 = none)
    # continuous alignment (issue 19): recording, feedback (server/recording.py, server/routes_feedback.py)
    record: str = "none"             # none | sample | all: which served samples go to the store
    record_fraction: float = 0.1     # record=sample: the share of samples recorded
    store: str = "runs/feedback.db"  # SQLite feedback store (store.open_store), shared by the servers of a host
    store_max_records: int = 100_000  # bound of the store: oldest records go first
    store_max_age_s: float = 7 * 86400.0  # records older than this are pruned
    feedback_token: str = ""         # bearer token of POST /v1/feedback; "" = env DLRL_FEEDBACK_TOKEN, else disabled
    feedback_labels: dict[str, float] = field(default_factory=lambda: {"accept": 1.0, "reject": 0.0})

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"server.port: {self.port} is not a TCP port")
        if self.backend not in BACKENDS:
            raise ConfigError(f"server.backend: {self.backend!r} is not one of {BACKENDS}")
        if self.default_strategy not in STRATEGIES:
            raise ConfigError(f"server.default_strategy: {self.default_strategy!r} is not one of {STRATEGIES}")
        for name in ("max_batch", "max_queue", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"server.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"server.max_body_bytes: must be >= 1, got {self.max_body_bytes}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"server.shutdown_timeout: must be >= 0, got {self.shutdown_timeout}")
        if self.block_size < 0:
            raise ConfigError(f"server.block_size: must be >= 0 (0 = from config.json), got {self.block_size}")
        if self.mask_token_id < -1:
            raise ConfigError(f"server.mask_token_id: must be >= 0 (-1 = from the folder), got {self.mask_token_id}")
        if self.max_model_len < 0:
            raise ConfigError(f"server.max_model_len: must be >= 0, got {self.max_model_len}")
        if not 0.0 <= self.default_threshold <= 1.0:
            raise ConfigError(f"server.default_threshold: must be in [0, 1], got {self.default_threshold}")
        if not 0 < self.weight_sync_lease_s <= 3600:
            raise ConfigError(f"server.weight_sync_lease_s: must be in (0, 3600], got {self.weight_sync_lease_s}")
        if not 0 <= self.weight_sync_drain_timeout_s <= 3600:
            raise ConfigError("server.weight_sync_drain_timeout_s: must be in [0, 3600], "
                              f"got {self.weight_sync_drain_timeout_s}")
        if self.default_temperature < 0:
            raise ConfigError(f"server.default_temperature: must be >= 0, got {self.default_temperature}")
        self._validate_alignment()

    def _validate_alignment(self) -> None:
        if self.record not in RECORD_MODES:
            raise ConfigError(f"server.record: {self.record!r} is not one of {RECORD_MODES}")
        if not 0.0 <= self.record_fraction <= 1.0:
            raise ConfigError(f"server.record_fraction: must be in [0, 1], got {self.record_fraction}")
        if not 0 <= self.keep_versions <= 64:
            raise ConfigError(f"server.keep_versions: must be in [0, 64], got {self.keep_versions}")
        if self.store_max_records < 1:
            raise ConfigError(f"server.store_max_records: must be >= 1, got {self.store_max_records}")
        if not self.store_max_age_s > 0:
            raise ConfigError(f"server.store_max_age_s: must be > 0, got {self.store_max_age_s}")
        if (self.record != "none" or self.resolved_feedback_token()) and not self.store:
            raise ConfigError("server.store: a path is needed when recording or feedback is on")
        for label, reward in self.feedback_labels.items():
            if not isinstance(label, str) or not label or len(label) > 64:
                raise ConfigError(f"server.feedback_labels: label {label!r} must be a string of 1-64 characters")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise ConfigError(f"server.feedback_labels.{label}: reward must be a finite number, got {reward!r}")
        token = self.resolved_feedback_token()
        if token and token == (self.admin_token or os.environ.get("DLRL_ADMIN_TOKEN", "")).strip():
            raise ConfigError("server.feedback_token: must differ from the admin token (a feedback client "
                              "must not be able to administer the server)")

    def resolved_feedback_token(self) -> str:
        """The feedback token: `feedback_token`, else env DLRL_FEEDBACK_TOKEN, else "" (feedback disabled)."""
        return (self.feedback_token or os.environ.get(FEEDBACK_ENV_VAR, "")).strip()

    def model_name(self, model_path: str | Path | None = None) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = model_path or self.model
        return Path(str(path)).name if path else "dlrl-tiny"


def load_server_config(path: str | Path | None, overrides: list[str] | None = None) -> ServerConfig:
    """The `server` section of the YAML at `path` (None = defaults) with overrides applied."""
    return load_section(ServerConfig, path, "server", overrides)
