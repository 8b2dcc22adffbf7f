"""Helpers shared by test modules (tests never import each other): free ports, real `dlrl serve`
subprocesses on loopback, admin calls, waiting on a condition with a deadline, the tiny
random SDAR config of the dllm tests, continuous batching of standalone decoding (`drive`), a weight
receiver serving a dict of tensors (ServedTensors).

    with served_process(model_dir, token="t", log_dir=tmp) as srv:   # a real server process
        admin_get(srv.url, "/weights/version", "t")
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dllm.config import SDARConfig
from dllm.sampling import SamplingParams

ADMIN_TOKEN = "secret"  # the session test server's admin token (what the `admin_headers` fixture sends)
FIXTURE_CONFIG = str(Path(__file__).parent / "fixtures" / "sdar-1.7b-chat.config.json")


def tiny_config(**kw) -> SDARConfig:
    """A tiny random SDAR config (vocab 64, 2 layers, block 4, mask 63, eos 0); `kw` overrides fields."""
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, block_size=4, mask_token_id=63, eos_token_id=0,
                rope_theta=10000.0)
    base.update(kw)
    return SDARConfig(**base)


def drive(runner, requests: list[tuple[list[int], SamplingParams]], admit: int = 2, decoder=None) -> list:
    """Continuous batching with dllm's scheduler (dllm.decoding.Decoder): `admit` more sequences join the
    queue every step while others run -> the sequences, in request order, once all ended."""
    from dllm.decoding import Decoder

    dec = decoder or Decoder(runner)
    seqs = [dec.runner.new_sequence(p, q) for p, q in requests]
    waiting = list(seqs)
    while waiting or not dec.is_done:
        dec.add(waiting[:admit])
        waiting = waiting[admit:]
        dec.step()
    return seqs


class Recompiles(logging.Handler):
    """torch's recompile events (torch._logging 'recompiles', on the torch._dynamo loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Recompiling" in record.getMessage():
            self.messages.append(record.getMessage())


@contextlib.contextmanager
def watch_recompiles(reset: bool = False) -> Iterator[Recompiles]:
    """torch's recompile events while the block runs (a Recompiles handler on torch._dynamo's logger); on the
    way out the logs go back to their defaults and, with `reset`, dynamo's caches are dropped (a compiled
    step's per-bucket graphs would serve, or crowd out, other tests' decode steps)."""
    import torch

    events, logger = Recompiles(), logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(events)
    try:
        yield events
    finally:
        logger.removeHandler(events)
        torch._logging.set_logs()
        if reset:
            torch._dynamo.reset()


def assert_same_decoding(got: list, ref: list, atol: float = 1e-5) -> None:
    """Two decodings of the same requests (drive's sequences) agree: tokens, trace steps, logprobs within `atol`."""
    import numpy as np

    for x, y in zip(got, ref, strict=True):
        assert x.completion_ids == y.completion_ids and x.trace.steps == y.trace.steps
        assert np.allclose(x.trace.logprobs, y.trace.logprobs, atol=atol, rtol=0)


def load_full_models(root: Path, block_size: int = 4) -> dict:
    """The tiny random LLaDA and Dream folders (dllm.embedded.full_folders, default seed) built under `root` and
    loaded: family -> FullAttentionLM."""
    from dllm.embedded.full_folders import build_full_folder
    from dllm.full.model import FullAttentionLM
    from dllm.weights import load_pretrained

    out = {}
    for family in ("llada", "dream"):
        m = load_pretrained(build_full_folder(root / family, family), block_size=block_size)
        assert isinstance(m, FullAttentionLM)
        out[family] = m
    return out


class OverflowingParams(SamplingParams):
    """Bypasses the greedy floor: logits / 1e-45 overflow and the row's probabilities become NaN."""

    @property
    def is_greedy(self) -> bool:
        return False


def parity_reward(text: str, example: dict, num_tokens: int | None = None) -> float:
    """A reward with variance on a random model: parity of a hash of the completion."""
    import zlib

    return float(zlib.crc32(text.encode()) % 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(cmd: list[str], timeout: float, **popen_kw: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=...)` in a session of its own: when it
    times out or the test is interrupted (pytest-timeout, Ctrl-C), its whole process group is killed, so the
    servers and ranks it started do not outlive it (subprocess.run would kill only `cmd`). What it leaves
    behind after exiting by itself is left for the test to see."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **popen_kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)


def is_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ServerProcess:
    """A `dlrl serve` subprocess on loopback (start_server_process); its output goes to `log_path`."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    model_dir: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal `dlrl serve` and return once the whole server is gone: its engine core and API processes die
        with it (a parent-death signal), but an API process may take a moment to let go of the port, which a
        server restarted on the same port would otherwise find in use."""
        if self.proc.poll() is None:
            import psutil

            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
            _, alive = psutil.wait_procs(children, timeout=30)
            for child in alive:
                child.kill()

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL when it has not exited within `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_server_process(model_dir: str, token: str, log_dir: Path, *overrides: str, port: int | None = None,
                          env: dict[str, str] | None = None) -> ServerProcess:
    """Start `dlrl serve` (CPU, fp32, 64 slots, admin token `token`; `overrides` win) without waiting for it."""
    port = port or free_port()
    log_path = Path(log_dir) / f"server-{port}.log"
    cmd = [sys.executable, "-m", "dlrl.cli", "serve", "--model", model_dir, "--port", str(port), "server.max_batch=64",
           "server.device=cpu", "server.dtype=float32", *overrides]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, "DLRL_ADMIN_TOKEN": token, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT)
    return ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, model_dir)


def wait_server_ready(servers: list[ServerProcess], timeout: float = 120) -> None:
    """Wait (bounded) until every server's /ready answers 200; on any failure kill them all, naming the one
    that exited with the end of its log."""
    try:
        for srv in servers:
            wait_until(lambda srv=srv: is_ready(srv.url) or srv.proc.poll() is not None, timeout, f"server {srv.url}")
            if srv.proc.poll() is not None:
                raise RuntimeError(f"server {srv.url} exited: {srv.log()[-2000:]}")
    except BaseException:
        for srv in servers:
            srv.kill()
        raise


def start_server_process(model_dir: str, token: str, log_dir: Path, *overrides: str, port: int | None = None,
                         env: dict[str, str] | None = None, timeout: float = 120) -> ServerProcess:
    """`dlrl serve` on a free loopback port (or `port`), ready when this returns."""
    srv = launch_server_process(model_dir, token, log_dir, *overrides, port=port, env=env)
    wait_server_ready([srv], timeout)
    return srv


def start_sync_server(model_dir: str, token: str, log_dir: Path, lease_s: float, *overrides: str,
                      cpu_only: bool = True) -> ServerProcess:
    """`dlrl serve` as the weight-sync tests run it: an update lease of `lease_s`, 4 slots, 128 tokens; on the CPU
    with CUDA hidden from it (CUDA_VISIBLE_DEVICES empty) unless not `cpu_only`."""
    return start_server_process(model_dir, token, log_dir, f"server.weight_sync_lease_s={lease_s}", "server.max_batch=4",
                                "server.max_model_len=128", *overrides,
                                env={"CUDA_VISIBLE_DEVICES": ""} if cpu_only else None)


def start_server_processes(count: int, model_dir: str, token: str, log_dir: Path, *overrides: str,
                           timeout: float = 120) -> list[ServerProcess]:
    """`count` servers started together (they load at the same time rather than one after the other)."""
    servers = [launch_server_process(model_dir, token, log_dir, *overrides) for _ in range(count)]
    wait_server_ready(servers, timeout)
    return servers


@contextlib.contextmanager
def served_process(model_dir: str, token: str, log_dir: Path, *overrides: str) -> Iterator[ServerProcess]:
    srv = start_server_process(model_dir, token, log_dir, *overrides)
    try:
        yield srv
    finally:
        srv.kill(signal.SIGTERM)


def shm_in_use() -> set[str]:
    """Names of the /dev/shm segments some live process has open or mapped (/proc/*/fd, /proc/*/maps)."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].removesuffix(" (deleted)"))
            for line in (proc / "maps").read_text().splitlines():
                if " /dev/shm/" in line:
                    used.add(line.split(" /dev/shm/", 1)[1].removesuffix(" (deleted)"))
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return used


def shm_left_behind(before: set[str], settle_s: float = 1.0) -> set[str]:
    """Segments created since `before` (a listing of /dev/shm) that no live process holds: leaked ones.
    Segments that other tests' live processes hold (the suite runs on parallel workers) are not leaks;
    one whose creator is unlinking it right now is gone after `settle_s`."""
    def candidates() -> set[str]:
        return set(os.listdir("/dev/shm")) - before - shm_in_use()

    left = candidates()
    if left:
        time.sleep(settle_s)
        left &= candidates()
    return left


def engine_core_pid(url: str) -> int:
    """The pid of a `dlrl serve`'s engine core (where the model and the weight receiver live), from /health."""
    processes = httpx.get(url + "/health", timeout=10).json()["processes"]
    return next(p["pid"] for p in processes if p["role"] == "engine_core")


def admin_get(url: str, path: str, token: str) -> dict:
    """An admin GET that must answer 200 -> its JSON body."""
    r = httpx.get(url + path, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


class ServedTensors:
    """A served 'model' (a dict of tensors) behind a weight_sync.WeightReceiver. Like the server's
    engine it owns the served version, which the receiver reads: `commit` / `apply` copy through
    the receiver, then serve `version`. `fail_apply` makes the copy raise before writing."""

    def __init__(self, params: dict, **receiver_kw) -> None:
        from weight_sync import WeightReceiver

        self.params, self.version, self.num_applied, self.fail_apply = params, 0, 0, False
        self.rx = WeightReceiver(lambda: self.params, self.copy, served_version=lambda: self.version, **receiver_kw)

    def commit(self, version: int, checksums: list | None = None, run_id: str = "") -> None:
        self.rx.commit(version, checksums, run_id)
        self.version = version

    def apply(self, version: int) -> None:
        self.rx.apply(version)
        self.version = version

    def copy(self, named) -> None:
        if self.fail_apply:
            raise ValueError("boom")
        for name, t in named:
            self.params[name].copy_(t)
        self.num_applied += 1

    def digest(self) -> str:
        from weight_sync import weights_digest

        return weights_digest(self.params)


def fake_zero3_gather(monkeypatch) -> list[list[int]]:
    """Install a stand-in `deepspeed` module whose `zero.GatheredParameters` records the ids of
    each group it gathers (into the returned list), for tests of the ZeRO-3 weight source on a
    box without deepspeed's partitioning."""
    import types

    gathered: list[list[int]] = []

    class GatheredParameters:
        def __init__(self, params, modifier_rank=None):
            self.params = params

        def __enter__(self):
            gathered.append([id(p) for p in self.params])

        def __exit__(self, *exc):
            return False

    fake = types.ModuleType("deepspeed")
    fake.zero = types.SimpleNamespace(GatheredParameters=GatheredParameters)
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    return gathered


def write_train_config(tmp: Path, servers: list[str], model: str, token: str, **train) -> Path:
    """tmp/cfg.yaml with a short `train` section against running `servers` (2 steps of 4 prompts x 4,
    6 tokens, the parity reward, no eval, no tensorboard); `train` overrides any key."""
    import json

    cfg = {"train": {"servers": servers, "model": model, "output_dir": str(tmp / "run"), "num_steps": 2,
                     "prompts_per_step": 4, "group_size": 4, "max_tokens": 6, "eval_every": 0,
                     "reward": "tests.helpers:parity_reward", "admin_token": token, "lr": 1e-3,
                     "start_server": False, "tensorboard": False, **train}}
    path = tmp / "cfg.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path
