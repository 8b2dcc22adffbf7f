"""ServerConfig: the `server` section of a dlrl YAML config (plus `key=value` overrides).

    cfg = load_server_config("configs/tiny.yaml", ["server.port=8001", "max_batch=8"])

`model=""` serves the embedded tiny default (`dllm.embedded.tiny.ensure_default_model`, trained on
first use). `admin_token=""` falls back to the `DLRL_ADMIN_TOKEN` env var; with neither,
admin endpoints are disabled. `max_model_len=0` means min(max_position_embeddings, 8192).
KV-cache memory: `kv_cache_memory` ("4GiB", "512MB", bytes) if not 0, else `kv_cache_fraction`
of the memory available after loading the weights (free CUDA memory / available RAM less the
`keep_versions` host copies of the weights); see server.engine.backends.native.plan_kv_cache.
The decode step (dllm/step.py) runs eagerly unless `compile` (torch.compile: each variant is
compiled on first use, tens of seconds on a small CPU) or `cuda_graphs` (CUDA only).
`prefix_caching` (block-causal models, native backend): the K/V pages of complete prompt blocks are
shared by the samples of a request and by requests with the same prefix, keyed by their tokens and
the weight version, and kept until their pages are needed (dllm/block_manager.py).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ByteSize, Field, StringConstraints

from dllm.cache_mode import DEFAULT_CACHE_MODE, CacheModeField
from dllm.options import Temperature, Threshold
from dllm.ranges import TEMPERATURE, THRESHOLD
from dllm.strategy import Strategy, StrategyField
from dlrl_config import Config, load_section

Backend = Literal["native", "lmdeploy"]  # lmdeploy: server/engine/backends/lmdeploy_runner.py (CUDA)
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
RecordMode = Literal["none", "sample", "all"]
FEEDBACK_ENV_VAR = "DLRL_FEEDBACK_TOKEN"
Label = Annotated[str, StringConstraints(min_length=1, max_length=64)]
Reward = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # a finite number (not a bool)


class ServerConfig(Config):
    host: str = "127.0.0.1"  # bind address
    port: int = Field(8000, ge=0, lt=65536)  # TCP port
    model: str = ""                  # HF-style folder; "" = embedded tiny default
    served_model_name: str = ""      # name in /v1/models; "" = the folder name
    backend: Backend = "native"
    cache_mode: CacheModeField = DEFAULT_CACHE_MODE  # full-attention models: exact (replayable) | prefix (Fast-dLLM prefix cache: faster, approximate)
    further_horizon: int = Field(-1, ge=-1)  # cache_mode=prefix: positions after the block its later forwards see (-1 = the family's official: LLaDA 128, Dream 32)
    ranking: Literal["official", "tempered"] = "official"  # full attention: confidence of a static forward (official: LLaDA's untempered softmax)
    rng: Literal["counter", "official"] = "counter"  # full attention: counter-based noise | the official rollouts' torch draws (bit-identical seeded rollouts)
    device: str = "auto"             # auto | cpu | cuda | cuda:N
    dtype: Dtype = "auto"            # auto = bf16 on CUDA, fp32 on CPU
    engine_core: Literal["process", "thread"] = "process"  # the step loop in its own process, or a thread of the API's
    api_processes: int = Field(1, ge=1, le=64)  # HTTP processes sharing the port (engine_core=process; server/core)
    api_nice: int = Field(0, ge=0, le=19)  # engine_core=process: added to the API processes' nice value, so that
    # under CPU contention (a flood on a small box) the engine core's step loop gets the CPU first
    max_batch: int = Field(16, ge=1)   # max concurrently decoded sequences (the KV-cache pages may allow fewer)
    max_queue: int = Field(256, ge=1)  # max waiting sequences before 429
    max_queue_tokens: int = Field(0, ge=0)  # max prompt + max_tokens of waiting sequences (0 = 4x the KV cache)
    api_keys_file: str = ""  # YAML of API keys with rate limits (server/api/quotas.py); "" = env DLRL_API_KEYS, else open
    max_concurrent_feedback: int = Field(64, ge=0)  # POST /v1/feedback calls in flight, past it 429 (0 = unlimited)
    store_threads: int = Field(4, ge=1, le=256)  # threads for feedback / store I/O (server/api/executors.py)
    weight_threads: int = Field(4, ge=1, le=256)  # threads for weight-update work (verify, digest, ...)
    default_threads: int = Field(4, ge=1, le=256)  # the event loop's default executor (everything else)
    max_request_s: float = Field(0.0, ge=0)  # longest a request may take (0 = no limit; a client `timeout` is capped)
    max_model_len: int = Field(0, ge=0)  # prompt + completion limit; 0 = min(max_position_embeddings, 8192)
    kv_cache_memory: ByteSize = Field(ByteSize(0), ge=0)  # KV-cache budget ("4GiB", "512MB", bytes); 0 = kv_cache_fraction
    kv_cache_fraction: float = Field(0.8, gt=0, le=1)  # share of free CUDA memory / available RAM after the weights
    compile: bool = False            # torch.compile the static decode step (dllm/step.py): faster steps, slow start
    cuda_graphs: bool = False        # CUDA only: capture each bucket's decode step once, replay it (ran on an H200)
    trace_free: bool = False         # withhold traces: rollouts marked trace-free, steps/logprobs 0 (as lmdeploy's)
    lmdeploy_steps: int = Field(0, ge=0)  # backend=lmdeploy: denoising steps per block, engine-wide (0 = block size)
    kv_admission: Literal["reserve", "optimistic"] = "reserve"  # optimistic: admit on pages in use, preempt + recompute
    prefix_caching: bool = True      # block-causal: share complete prompt blocks (n samples, common prefixes), by version
    trust_remote_code: bool = False  # run the model folder's own Python code (tokenizer/config); never asked
    block_size: int = Field(0, ge=0)  # 0 = config.json's; set it for folders that lack it (or to decode with another)
    mask_token_id: int = Field(-1, ge=-1)  # -1 = config.json's, else the tokenizer's <|MASK|>
    admin_token: str = ""  # bearer token of the admin endpoints (else env DLRL_ADMIN_TOKEN, else admin_token_file)
    admin_token_file: str = ""       # read (or create) the token here when none is set otherwise
    log_level: LogLevel = "info"
    log_format: Literal["text", "json"] = "text"  # json: one JSON event per line (request id, version, timing)
    max_body_bytes: int = Field(4 << 20, ge=1)  # request bodies over this are a 413 before being read (weights exempt)
    shutdown_timeout: float = Field(20.0, ge=0)  # SIGTERM: seconds in-flight requests get before they are aborted
    # connection bounds (server/api/connections.py) and admin-auth throttling (server/api/auth.py)
    header_timeout_s: float = Field(10.0, gt=0, le=3600)  # request line + headers must arrive within this: else 408
    read_timeout_s: float = Field(60.0, gt=0, le=3600)    # a request body stalled this long: 408, closed
    keepalive_timeout_s: float = Field(5.0, gt=0, le=3600)  # an idle kept-alive connection is closed after this
    max_connections: int = Field(1024, ge=1)  # open connections (lowered to fit ulimit -n less the reserves)
    max_connections_per_ip: int = Field(256, ge=1)  # open connections of one client address
    reserved_connections: int = Field(16, ge=0)  # extra slots past the caps for /health, /ready, /metrics, admin
    fd_reserve: int = Field(256, ge=16)  # file descriptors kept free of connections (files, stores, accept bursts)
    listen_backlog: int = Field(64, ge=1)  # kernel accept queue; also the most connections accepted in one burst
    http: Literal["auto", "h11", "httptools"] = "auto"  # HTTP/1.1 parser: auto = httptools (C) when installed
    loop: Literal["auto", "asyncio", "uvloop"] = "auto"  # event loop: auto = uvloop when installed
    resource_log_interval_s: float = Field(10.0, gt=0)  # refusals, resource errors, auth failures: one line per interval
    auth_max_failures: int = Field(10, ge=1)  # failed admin/feedback token checks of a client within the window ...
    auth_failure_window_s: float = Field(60.0, gt=0)  # ... after which it gets 429 with Retry-After ...
    auth_throttle_s: float = Field(60.0, gt=0)  # ... for this long
    # defaults for requests that leave these unset
    default_max_tokens: int = Field(64, ge=1)  # max_tokens of requests that leave it unset
    default_strategy: StrategyField = Strategy.dynamic  # strategy of requests that leave it unset
    default_threshold: Threshold = THRESHOLD.default  # threshold of requests that leave it unset
    default_temperature: Temperature = TEMPERATURE.default  # temperature of requests that leave it unset
    # prompt log-likelihoods (echo + logprobs, max_tokens 0; server/api/likelihood.py, dllm/likelihood.py)
    likelihood: Literal["sequential", "elbo"] = "sequential"  # block-causal: exact sequential-policy, or the Monte Carlo ELBO (full attention: always elbo)
    elbo_samples: int = Field(16, ge=1, le=1024)  # elbo: masking samples per estimate (seeded; LLaDA / Dream: per context / continuation split)
    # weight sync (server side of weight_sync; see server/weights/weight_updates.py)
    weight_sync_lease_s: float = Field(30.0, gt=0, le=3600)  # an update with no data-plane progress is aborted
    weight_sync_drain_timeout_s: float = Field(30.0, ge=0, le=3600)  # commit waits this long for in-flight...
    weight_sync_abort_inflight: bool = False   # ... then aborts them (true) or lets them finish on the old weights
    weight_sync_check_finite: bool = True      # refuse updates holding NaN/inf (400), nothing applied
    keep_versions: int = Field(2, ge=0, le=64)  # weight versions kept in host memory for POST /weights/rollback
    # continuous alignment (issue 19): recording, feedback (server/recording/recording.py, server/api/routes_feedback.py)
    record: RecordMode = "none"      # none | sample | all: which served samples go to the store
    record_fraction: float = Field(0.1, ge=0, le=1)  # record=sample: the share of samples recorded
    store: str = "runs/feedback.db"  # SQLite feedback store (store.open_store), shared by the servers of a host
    store_max_records: int = Field(100_000, ge=1)  # bound of the store: oldest records go first
    store_max_age_s: float = Field(7 * 86400.0, gt=0)  # records older than this are pruned
    record_wait_s: float = Field(5.0, gt=0, le=600)  # a response waits this long for its records' commit
    record_max_pending: int = Field(10_000, ge=1)    # records queued for the store writer; beyond: dropped
    store_error_log_s: float = Field(30.0, gt=0)     # while the store fails: one log line per this many s
    feedback_token: str = ""         # bearer token of POST /v1/feedback; "" = env DLRL_FEEDBACK_TOKEN, else disabled
    feedback_labels: dict[Label, Reward] = Field(default_factory=lambda: {"accept": 1.0, "reject": 0.0})  # feedback label -> reward

    def check(self) -> None:
        for key, module in (("http", "httptools"), ("loop", "uvloop")):
            if getattr(self, key) == module and not _installed(module):
                raise ValueError(f"server.{key}: {module} is not installed (pip install '.[server]' or "
                                 f"pip install {module}); use server.{key}=auto or the pure-Python default")
        if self.api_processes > 1 and self.engine_core == "thread":
            raise ValueError(f"server.api_processes: {self.api_processes} API processes need the engine in its own "
                             "process (server.engine_core=process); with engine_core=thread there is one process")
        if self.listen_backlog >= self.fd_reserve:
            raise ValueError(f"server.listen_backlog: {self.listen_backlog} must be below server.fd_reserve "
                             f"({self.fd_reserve}): a burst of accepted connections needs free descriptors")
        if (self.record != "none" or self.resolved_feedback_token()) and not self.store:
            raise ValueError("server.store: a path is needed when recording or feedback is on")
        token = self.resolved_feedback_token()
        if token and token == (self.admin_token or os.environ.get("DLRL_ADMIN_TOKEN", "")).strip():
            raise ValueError("server.feedback_token: must differ from the admin token (a feedback client "
                             "must not be able to administer the server)")

    def resolved_http(self) -> Literal["h11", "httptools"]:
        """The HTTP/1.1 protocol to serve with: `http`, with auto = httptools when importable, else h11."""
        if self.http == "auto":
            return "httptools" if _installed("httptools") else "h11"
        return self.http

    def resolved_loop(self) -> Literal["asyncio", "uvloop"]:
        """The event loop to serve on: `loop`, with auto = uvloop when importable, else asyncio."""
        if self.loop == "auto":
            return "uvloop" if _installed("uvloop") else "asyncio"
        return self.loop

    def resolved_feedback_token(self) -> str:
        """The feedback token: `feedback_token`, else env DLRL_FEEDBACK_TOKEN, else "" (feedback disabled)."""
        return (self.feedback_token or os.environ.get(FEEDBACK_ENV_VAR, "")).strip()

    def model_name(self, model_path: str | Path | None = None) -> str:
        from dllm.hub import served_name

        return served_name(str(self.model or model_path or ""), self.served_model_name)  # a repo id: its name


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def load_server_config(path: str | Path | None, overrides: list[str] | None = None) -> ServerConfig:
    """The `server` section of the YAML at `path` (None = defaults) with overrides applied."""
    return load_section(ServerConfig, path, "server", overrides)
