"""ServerConfig: the `server` section of a dlrl YAML config (plus `key=value` overrides).

    cfg = load_server_config("configs/tiny.yaml", ["server.port=8001", "max_batch=8"])

`model=""` serves the embedded tiny default (`dllm.tiny.ensure_default_model`, trained on
first use). `admin_token=""` falls back to the `DLRL_ADMIN_TOKEN` env var; with neither,
admin endpoints are disabled. `max_model_len=0` means min(max_position_embeddings, 8192).
KV-cache memory: `kv_cache_memory` ("4GiB", "512MB", bytes) if set, else `kv_cache_fraction`
of the memory available after loading the weights (free CUDA memory / available RAM);
see server.backends.native.plan_kv_cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dllm.configlib import ConfigError, load_section

BACKENDS = ("native", "lmdeploy")
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
    max_batch: int = 16              # max concurrently decoded sequences (the KV-cache pages may allow fewer)
    max_queue: int = 256             # max waiting sequences before 429
    max_model_len: int = 0           # prompt + completion limit; 0 = min(max_position_embeddings, 8192)
    kv_cache_memory: str = ""        # KV-cache budget, e.g. "4GiB"; "" = kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.8   # share of free device memory (CUDA) / available RAM (CPU) after the weights
    admin_token: str = ""
    admin_token_file: str = ""       # read (or create) the token here when none is set otherwise
    log_level: str = "info"
    # defaults for requests that leave these unset
    default_max_tokens: int = 64
    default_strategy: str = "dynamic"
    default_threshold: float = 0.9
    default_temperature: float = 1.0

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
        if self.max_model_len < 0:
            raise ConfigError(f"server.max_model_len: must be >= 0, got {self.max_model_len}")
        if not 0.0 <= self.default_threshold <= 1.0:
            raise ConfigError(f"server.default_threshold: must be in [0, 1], got {self.default_threshold}")
        if self.default_temperature < 0:
            raise ConfigError(f"server.default_temperature: must be >= 0, got {self.default_temperature}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ConfigError(f"server.kv_cache_fraction: must be in (0, 1], got {self.kv_cache_fraction}")
        parse_memory(self.kv_cache_memory)

    def model_name(self, model_path: str | Path | None = None) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = model_path or self.model
        return Path(str(path)).name if path else "dlrl-tiny"


def parse_memory(text: str) -> int:
    """'4GiB', '512MB', '1.5 GiB' or a number of bytes -> bytes (0 for ''); ConfigError naming the key."""
    if not str(text).strip():
        return 0
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        num = int(TypeAdapter(ByteSize).validate_python(str(text).strip()))
    except ValidationError:
        num = 0
    if num <= 0:
        raise ConfigError(f"server.kv_cache_memory: {text!r} is not a memory size (e.g. 4GiB, 512MB, "
                          "or a number of bytes)")
    return num


def load_server_config(path: str | Path | None, overrides: list[str] | None = None) -> ServerConfig:
    """The `server` section of the YAML at `path` (None = defaults) with overrides applied."""
    return load_section(ServerConfig, path, "server", overrides)
