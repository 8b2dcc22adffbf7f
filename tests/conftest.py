"""Shared fixtures: a tiny random SDAR model + char tokenizer, real uvicorn servers on loopback,
a real PostgreSQL server (`postgres`) and `store_location` (each store backend in turn).

    def test_x(server):            # the main server: max_batch=8, admin token "secret"
        httpx.post(server.url + "/generate", json={"prompt": "1+2=", "max_tokens": 8})
        server.engine.max_batch_seen

`make_server(**config)` starts more servers with other limits (session-scoped, each in
its own thread, on a free port); all stop at the end of the session.

Device: the suite runs on CPU on every machine. Servers get `server.device=cpu`; trainers
(in-process DeepSpeed engines, `dlrl train` subprocesses, torchrun ranks: they inherit the
environment) get `DS_ACCELERATOR=cpu`, which `trainer.infra.dist` honours like `train.device=cpu`
(gloo, CPU tensors). CUDA-only tests are marked `gpu` and set their own devices.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dllm.embedded.tiny import SMALL_ARCH, random_tiny_folder
from tests.helpers import ADMIN_TOKEN, FIXTURE_CONFIG  # noqa: F401  (shared with test modules)

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # trainers on CPU even where a GPU is visible (see above)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one of `make test`'s parallel workers (one per core): one torch thread here and in every process it
    # starts, as two OpenMP threads per forward on a shared core spin against each other's
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a `slow` test run first (the order is kept otherwise, and a file's tests stay together):
    `make test` hands whole files to its workers (pytest-xdist `--dist loadfile`) in this order, so the
    long files start at once instead of one of them ending the run on a single worker."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A randomly initialised tiny SDAR model (block_size 4, char tokenizer) in HF layout."""
    return random_tiny_folder(tmp_path_factory.mktemp("tiny-random"), **SMALL_ARCH)


@dataclass
class RunningServer:
    url: str
    engine: Any
    app: Any
    config: Any
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def stop_all(servers: list[RunningServer], timeout: float = 15.0) -> None:
    """Stop servers together: all are told to exit first, then joined against one deadline (one at a time, a
    server that is slow to stop made the session's teardown wait 15 s for each: about 5 minutes in CI)."""
    for srv in servers:
        srv.server.should_exit = True
    deadline = time.monotonic() + timeout
    for srv in servers:
        srv.thread.join(timeout=max(0.1, deadline - time.monotonic()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, port: int | None = None, runner: Any = None, build: bool = False,
                 **overrides) -> RunningServer:
    """A real server of `model_dir` (native backend), or over `runner` when given (tests of other runners), or
    with `build` the engine `dlrl serve` builds from the config (the folder's family picks the runner)."""
    import uvicorn

    from server.api.app import create_app
    from server.api.connections import ConnectionLimits, bounded_protocol
    from server.config import ServerConfig
    from server.engine.backends.native import NativeBackend
    from server.engine.engine import Engine

    overrides.setdefault("auth_max_failures", 10_000)  # session servers: many tests send wrong tokens on purpose
    config = ServerConfig(model=model_dir, port=port or _free_port(), device="cpu", dtype="float32", **overrides)
    if build:
        from server.cli import build_engine

        engine = build_engine(config, model_dir)
    else:
        backend = runner or NativeBackend.from_pretrained(
            model_dir, device="cpu", dtype="float32", max_batch=config.max_batch, max_model_len=config.max_model_len,
            kv_cache_memory=config.kv_cache_memory, kv_cache_fraction=config.kv_cache_fraction,
            keep_versions=config.keep_versions, trace_free=config.trace_free, prefix_caching=config.prefix_caching)
        engine = Engine(backend, max_queue=config.max_queue, max_queue_tokens=config.max_queue_tokens,
                        model_name=config.model_name())
    app = create_app(engine, config)
    limits = ConnectionLimits.from_config(config)  # the protocol and loop `dlrl serve` runs (server.http/loop)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=2, loop=config.resolved_loop(),
                                           http=bounded_protocol(limits, config.resolved_http())))
    thread = threading.Thread(target=server.run, daemon=True, name=f"uvicorn-{config.port}")
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return RunningServer(url, engine, app, config, server, thread)
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError(f"server on {url} did not start")


@pytest.fixture(scope="session")
def make_server(make_server_for, tiny_model_dir):
    """Start a real server of the tiny random model (`make_server(max_batch=2, ...)`); all stop at the end."""
    saved = os.environ.pop("DLRL_ADMIN_TOKEN", None)  # tests decide the token explicitly
    yield lambda **overrides: make_server_for(tiny_model_dir, **overrides)
    if saved is not None:
        os.environ["DLRL_ADMIN_TOKEN"] = saved


@pytest.fixture(scope="session")
def server(make_server) -> RunningServer:
    """The main test server: 8 slots, queue 64, max_model_len 256, admin token 'secret'."""
    return make_server(max_batch=8, max_queue=64, max_model_len=256, admin_token=ADMIN_TOKEN)


@pytest.fixture
def admin_headers() -> dict:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class ServeProcess:
    """A real `dlrl serve` subprocess on a free loopback port."""

    proc: Any
    url: str
    log_path: Any

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def serve_process(tiny_model_dir, tmp_path):
    """Factory: `serve_process("server.shutdown_timeout=5", env={...})` starts `dlrl serve` on the tiny
    model, waits (bounded) until /ready answers 200, and kills what is left at the end of the test.
    One torch thread: a shared 2-core box makes two spinning OpenMP threads per forward very slow."""
    import subprocess
    import sys

    started: list[ServeProcess] = []

    def start(*overrides: str, env: dict | None = None, timeout: float = 90.0) -> ServeProcess:
        port = _free_port()
        log_path = tmp_path / f"serve-{port}.log"
        dlrl = os.path.join(os.path.dirname(sys.executable), "dlrl")  # the installed console script
        cmd = [dlrl, "serve", "--model", tiny_model_dir, "--port", str(port), *overrides, "server.device=cpu"]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        with open(log_path, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                    cwd=os.path.dirname(os.path.dirname(__file__)))
        srv = ServeProcess(proc, f"http://127.0.0.1:{port}", log_path)
        started.append(srv)
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, srv.log()
            try:
                if httpx.get(srv.url + "/ready", timeout=1).status_code == 200:
                    return srv
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"dlrl serve not ready after {timeout}s:\n{srv.log()}"
            time.sleep(0.1)

    yield start
    for srv in started:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(timeout=10)


SMALL_SHAPES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "max_position_embeddings": 4096}


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> str:
    """The Qwen2/Qwen3-style byte-level BPE stand-in tokenizer (dllm.embedded.standin), built once."""
    from dllm.embedded.standin import build_qwen_tokenizer

    path = tmp_path_factory.mktemp("qwen-tok")
    build_qwen_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def small_sdar_dir(tmp_path_factory, qwen_tokenizer_dir) -> str:
    """Every field of the SDAR-1.7B-Chat config.json, small shapes (vocab kept: 151936), 2 layers,
    bf16 random weights whose <|im_end|> row makes turns end after a few tokens, the stand-in
    tokenizer and a generation_config.json (eos [<|im_end|>, <|endoftext|>])."""
    from dllm.embedded.standin import build_real_shape_folder

    path = tmp_path_factory.mktemp("small-sdar")
    return str(build_real_shape_folder(path, FIXTURE_CONFIG, num_hidden_layers=2, overrides=SMALL_SHAPES,
                                       tokenizer_from=qwen_tokenizer_dir, max_shard_bytes=16 << 20))


@pytest.fixture(scope="session")
def make_server_for():
    """Start a real server (uvicorn thread, loopback) on any model folder; all stop at the end."""
    started: list[RunningServer] = []

    def make(model_dir: str, **overrides) -> RunningServer:
        srv = start_server(model_dir, **overrides)
        started.append(srv)
        return srv

    yield make
    stop_all(started)


@pytest.fixture(scope="session")
def one_rank():
    """This process as a torch.distributed group of one (gloo, in-memory store; trainer.infra.dist.Ranks): for
    DeepSpeed engines built in the test process (tests/trainer/ranks_worker.py's cases)."""
    from trainer.infra.dist import Ranks

    return Ranks.init()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the session (tests/postgres.py), started on first use."""
    from tests.postgres import PostgresServer

    pg = PostgresServer.start()
    yield pg
    pg.destroy()


@pytest.fixture(params=["sqlite", "postgres"])
def store_location(request, tmp_path):
    """Where a parametrised store test opens its store: an SQLite file, or a fresh database on
    the session's PostgreSQL server (the same suite runs on both backends)."""
    if request.param == "sqlite":
        return str(tmp_path / "fb.db")
    pg = request.getfixturevalue("postgres")
    return pg.new_database(f"t{abs(hash(request.node.nodeid)) % 10**12}")
