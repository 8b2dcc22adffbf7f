"""Benchmark weight sync: connect, first and steady pushes for shm / dist / http / cuda_ipc vs memcpy, raw gloo, checkpoint.

    .venv/bin/python benchmarks/sync.py                       # 100m and 500m (a few minutes)
    .venv/bin/python benchmarks/sync.py --sizes 10m,100m      # shorter
    .venv/bin/python benchmarks/sync.py --transports shm,dist --pushes 4
    .venv/bin/python benchmarks/sync.py --dtype bfloat16      # the server serves bf16: half the bytes sent
    .venv/bin/python benchmarks/sync.py --sizes 10m,100m --transports shm,cuda_ipc   # cuda_ipc's CPU kind
    .venv/bin/python benchmarks/sync.py --device cuda --sizes 1.7b --transports cuda_ipc,shm --dtype bfloat16 \
        --pushes 4 --skip-checkpoint                          # GPU: the 4.1 GB SDAR-1.7B shape (gpu_session.sh)

For each size it builds fp32 random tensors shaped like an SDAR/Qwen3 model (embeddings,
q/k/v/o, gate/up/down, norms, untied lm_head), starts a receiver in ANOTHER process (the
real server.api.routes_weights + WeightUpdates glue over uvicorn, with an idle engine), and
from this process times, per transport: `WeightSender.connect` (one-time: shm region,
dist group, server staging), the first push after it and the median of the following
pushes. Baselines measured in the same run: a same-process memcpy of the same bytes
(`Tensor.copy_` into preallocated tensors, best of 3, taken just before each transport's
pushes), a raw gloo broadcast of the same buckets
between the same two processes (no packing, hashing or control plane), and the
checkpoint path (save_file + fsync, then the receiver loads the file and copies it into
its params; the reload hits the page cache). After timing, the receiver's digest is
checked against the sender's. The last lines check the acceptance ratios of issue 12 (and,
for cuda_ipc on CUDA, issue 39's: a push of the 1.7B model <= 50 ms, verification included).
`--device cuda` puts the receiver's model and the sender's tensors on the GPU (the sender's
already in the served dtype, as a bf16 trainer's are); cuda_ipc then shares device memory by
IPC handle, on CPU it runs its CPU kind (torch-shared host memory: the protocol, not the GPU path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# (vocab, hidden, intermediate, layers): ~10M, ~100M, ~500M parameters
SIZES = {"10m": (8192, 256, 768, 8), "100m": (32000, 768, 2048, 8), "500m": (64000, 1536, 4096, 12),
         "1.7b": (151936, 2048, 6144, 28)}  # 1.7b: SDAR-1.7B's shapes, 2.0B parameters (4.1 GB in bf16)
TOKEN = "bench"


def sdar_like(size: str, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Named fp32 tensors with SDAR parameter names and shapes (head_dim 64, kv heads = heads / 2)."""
    vocab, d, inter, layers = SIZES[size]
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (d // 2, d),
            p + "self_attn.v_proj.weight": (d // 2, d), p + "self_attn.o_proj.weight": (d, d),
            p + "self_attn.q_norm.weight": (64,), p + "self_attn.k_norm.weight": (64,),
            p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        })
    shapes.update({"model.norm.weight": (d,), "lm_head.weight": (vocab, d)})
    return {n: torch.empty(s, device=device).uniform_(-0.05, 0.05, generator=g) for n, s in shapes.items()}


def module_from(named: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An nn.Module whose named_parameters() are exactly `named` (nested by dotted names)."""
    root = torch.nn.Module()
    for name, t in named.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


# ---- receiver process -----------------------------------------------------------------------
def idle_engine(model: torch.nn.Module) -> Any:
    """A real server.engine.engine.Engine, never started (its backend only `model`): the weight window
    (server.engine.engine.Engine.apply_update) without a decode loop to pause."""
    from server.engine.backends.base import RunnerInfo
    from server.engine.engine import Engine
    from server.engine.scheduler import KVBudget

    return Engine(SimpleNamespace(model=model, kv_budget=KVBudget(1), postprocessor=lambda: None,
                                  info=RunnerInfo("sdar")))


def serve(size: str, port: int, dtype: str) -> None:
    """The receiver process (its model on $SYNC_BENCH_DEVICE, default cpu)."""
    import logging

    import uvicorn
    from fastapi import FastAPI
    from safetensors.torch import load_file

    logging.basicConfig(level=logging.WARNING, format="  receiver: %(message)s")
    logging.getLogger("dlrl.server").setLevel(logging.INFO if os.environ.get("SYNC_BENCH_VERBOSE") else logging.WARNING)

    from dllm.weights import copy_into_model
    from server.api import routes_weights
    from server.api.state import ServerState, attach
    from server.config import ServerConfig
    from server.weights.weight_updates import make_updates

    device = os.environ.get("SYNC_BENCH_DEVICE", "cpu")
    served = {n: t.to(getattr(torch, dtype)) for n, t in sdar_like(size, seed=1, device=device).items()}
    engine = idle_engine(module_from(served))
    app = FastAPI()
    attach(app, ServerState(engine, admin_token=TOKEN, weight_updates=make_updates(engine, ServerConfig(keep_versions=0))))
    app.include_router(routes_weights.router)

    @app.post("/bench/load_checkpoint")
    def load_checkpoint(body: dict) -> dict:  # the checkpoint path: read file, copy into params
        t0 = time.perf_counter()
        copy_into_model(engine.model, load_file(body["path"]).items())
        return {"load_s": time.perf_counter() - t0}

    @app.post("/bench/gloo")
    def gloo(body: dict) -> dict:  # raw broadcast baseline: join and receive, nothing else
        threading.Thread(target=raw_gloo_receive, args=(body,), daemon=True).start()
        return {}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ---- raw gloo broadcast baseline ------------------------------------------------------------
def _gloo_group(addr: str, port: int, rank: int, store_fd: int | None = None):
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(addr, port, None, rank == 0, datetime.timedelta(seconds=120), wait_for_workers=False,
                          master_listen_fd=store_fd) if rank == 0 else \
        dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=120))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    opts._timeout = datetime.timedelta(seconds=120)
    return store, dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, opts)


def _broadcast_all(pg, bufs: list[torch.Tensor], sizes: list[int]) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for i, n in enumerate(sizes):
        pg.broadcast([bufs[i % 2][:n]], opts).wait()


def raw_gloo_receive(body: dict) -> None:
    store, pg = _gloo_group(body["addr"], body["port"], 1)
    bufs = [torch.empty(max(body["sizes"]), dtype=torch.uint8) for _ in range(2)]
    for _ in range(body["rounds"]):
        _broadcast_all(pg, bufs, body["sizes"])
    pg.shutdown()


def time_raw_gloo(url: str, sizes: list[int], rounds: int = 3) -> float:
    """Median time to broadcast buckets of `sizes` bytes to the receiver process over a bare gloo group."""
    import socket

    import httpx

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    httpx.post(url + "/bench/gloo", json={"addr": "127.0.0.1", "port": port, "sizes": sizes, "rounds": rounds},
               headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60).raise_for_status()
    store, pg = _gloo_group("127.0.0.1", port, 0, sock.detach())
    bufs = [torch.ones(max(sizes), dtype=torch.uint8) for _ in range(2)]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        _broadcast_all(pg, bufs, sizes)
        times.append(time.perf_counter() - t0)
    pg.shutdown()
    return statistics.median(times[1:]) if rounds > 1 else times[0]


# ---- sender side ---------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_receiver(size: str, threads: int, dtype: str, script: str = __file__,
                   ready: Callable[[str], bool] | None = None, device: str = "cpu") -> tuple[subprocess.Popen, str]:
    """`script --serve size` in another process (this file's receiver, or benchmarks/rollback.py's);
    returns once `ready(url)` (default: /weights/version answers)."""
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SYNC_BENCH_DEVICE": device}
    cmd = [sys.executable, script, "--serve", size, "--port", str(port), "--threads", str(threads),
           "--dtype", dtype]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "receiver process died"
        try:
            r = httpx.get(url + "/weights/version", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2)
            if ready is None or (r.status_code == 200 and ready(url)):
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("receiver did not start")


def bench_parser(doc: str, sizes: str, transports: str, pushes: int, pushes_help: str | None = None
                 ) -> argparse.ArgumentParser:
    """The flags this file and benchmarks/rollback.py share: --sizes, --transports, --pushes (more
    may follow; add_receiver_args last)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--sizes", default=sizes, help=f"comma list of {','.join(SIZES)}")
    ap.add_argument("--transports", default=transports)
    ap.add_argument("--pushes", type=int, default=pushes, help=pushes_help)
    return ap


def add_receiver_args(ap: argparse.ArgumentParser, dtype_help: str) -> None:
    """--dtype (what the receiver serves), --threads and the receiver process's hidden --serve/--port."""
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help=dtype_help)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (sender and receiver share the cores)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)


def parse_or_serve(ap: argparse.ArgumentParser, serve: Callable[[str, int, str], None]
                   ) -> tuple[argparse.Namespace, list[str]] | None:
    """Parse the command line and set torch's threads. In the receiver process (--serve) run
    `serve(size, port, dtype)` and return None; else (args, the --sizes, checked against SIZES)."""
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.serve:
        serve(args.serve, args.port, args.dtype)
        return None
    sizes = [s.strip().lower() for s in args.sizes.split(",")]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown size {unknown[0]!r} (known: {', '.join(SIZES)})")
    return args, sizes


def _sync(named: dict[str, torch.Tensor]) -> None:
    if next(iter(named.values())).is_cuda:
        torch.cuda.synchronize()


def time_memcpy(named: dict[str, torch.Tensor], repeats: int = 3) -> float:
    dst = {n: torch.empty_like(t) for n, t in named.items()}
    times = []
    for _ in range(repeats):
        _sync(named)
        t0 = time.perf_counter()
        for n, t in named.items():
            dst[n].copy_(t)
        _sync(named)
        times.append(time.perf_counter() - t0)
    return min(times)


def time_checkpoint(named: dict[str, torch.Tensor], url: str) -> float:
    import httpx
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        t0 = time.perf_counter()
        save_file(named, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        r = httpx.post(url + "/bench/load_checkpoint", json={"path": path},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t0


def bench_transport(url: str, transport: str, named: dict[str, torch.Tensor], pushes: int,
                    version: int) -> tuple[dict, int]:
    import httpx

    from weight_sync import WeightSender, weights_digest

    on_cpu = next(iter(named.values())).device.type == "cpu"
    sender = WeightSender([url], transport=transport, token=TOKEN, timeout=600, dtype="auto",
                          ipc_allow_cpu=on_cpu)  # cuda_ipc on CPU: its CPU kind
    connect_s = sender.connect(named)["connect_s"]
    times, sent = [], 0
    for _ in range(pushes):
        version += 1
        timings = sender.push(named, version)
        times.append(timings["total_s"])
        sent = timings["bytes"]
    sizes = list(sender._layout[0]) if sender._layout else []
    sender.close()
    served = httpx.get(url + "/weights/checksum", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600).json()
    sent_named = {n: t.to(getattr(torch, served_dtype(url))).cpu() for n, t in named.items()}
    ok = served == {"version": version, "digest": weights_digest(sent_named)}
    steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
    return {"transport": transport, "connect_s": connect_s, "first_s": times[0], "steady_s": steady,
            "sent_mb": sent / 1e6, "bucket_sizes": sizes, "ok": ok}, version


def served_dtype(url: str) -> str:
    import httpx

    r = httpx.get(url + "/weights/version", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    return r.json()["dtype"]


def bench_size(size: str, transports: list[str], pushes: int, threads: int, dtype: str, device: str = "cpu",
               checkpoint: bool = True) -> list[dict]:
    named = sdar_like(size, seed=2, device=device)
    if device != "cpu":  # a GPU trainer's weights, already in the served dtype
        named = {n: t.to(getattr(torch, dtype)) for n, t in named.items()}
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    num_params = sum(t.numel() for t in named.values())
    proc, url = start_receiver(size, threads, dtype, device=device)
    rows = []
    try:
        ckpt_s = time_checkpoint(named, url) if checkpoint else float("nan")
        version = 0
        for transport in transports:
            memcpy_s = time_memcpy(named)  # right before the pushes it is compared with (the box is shared)
            row, version = bench_transport(url, transport, named, pushes, version)
            row["raw_gloo_s"] = time_raw_gloo(url, row.pop("bucket_sizes")) if transport == "dist" else None
            row.update(size=size, params_m=num_params / 1e6, mb=nbytes / 1e6, memcpy_s=memcpy_s, ckpt_s=ckpt_s,
                       device=device)
            rows.append(row)
            print_row(row)
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


HEADER = (f"{'size':>5} {'params':>8} {'sent MB':>8} {'transport':>9} {'connect':>8} {'first s':>8} {'push s':>7} "
          f"{'GB/s':>5} {'/memcpy':>7} {'first/':>6} {'raw gloo':>8} {'raw/push':>8} {'ckpt s':>7} "
          f"{'x ckpt':>7} {'digest':>6}")


def print_row(r: dict) -> None:
    raw = r.get("raw_gloo_s")
    raw_cols = f"{raw:>8.3f} {raw / r['steady_s']:>8.2f}" if raw else f"{'-':>8} {'-':>8}"
    print(f"{r['size']:>5} {r['params_m']:>7.1f}M {r['sent_mb']:>8.0f} {r['transport']:>9} {r['connect_s']:>8.3f} "
          f"{r['first_s']:>8.3f} {r['steady_s']:>7.3f} {r['sent_mb'] / 1e3 / r['steady_s']:>5.2f} "
          f"{r['steady_s'] / r['memcpy_s']:>6.2f}x {r['first_s'] / r['steady_s']:>5.2f}x {raw_cols} "
          f"{r['ckpt_s']:>7.2f} {r['ckpt_s'] / r['steady_s']:>6.1f}x {'ok' if r['ok'] else 'BAD':>6}", flush=True)


def check(rows: list[dict]) -> None:
    """Issue 12's acceptance ratios, PASS/FAIL per row."""
    for r in rows:
        tag = f"{r['size']} {r['transport']}"
        verdicts = [("first <= 1.5x steady", r["first_s"] <= 1.5 * r["steady_s"])]
        if r["transport"] == "shm":
            verdicts.append(("steady <= 2x memcpy", r["steady_s"] <= 2 * r["memcpy_s"]))
        if r["transport"] == "dist" and r.get("raw_gloo_s"):
            verdicts.append(("throughput >= 0.8x raw gloo", r["raw_gloo_s"] / r["steady_s"] >= 0.8))
        if r["transport"] != "http" and r["size"] == "500m":
            verdicts.append(("10x faster than checkpoint", r["ckpt_s"] / r["steady_s"] >= 10))
        if r["transport"] == "cuda_ipc" and r["size"] == "1.7b" and r.get("device") == "cuda":
            verdicts.append(("push <= 50 ms (issue 39)", r["steady_s"] <= 0.050))
        print(f"{tag:>10}: " + ", ".join(f"{name} {'PASS' if ok else 'FAIL'}" for name, ok in verdicts))


def main() -> None:
    ap = bench_parser(__doc__, "100m,500m", "shm,dist,http", 3, "pushes per transport after connect (first + steady)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides keep the weights")
    ap.add_argument("--skip-checkpoint", action="store_true", help="no checkpoint baseline (its ckpt columns: nan)")
    add_receiver_args(ap, "dtype the receiver serves (the sender uses dtype='auto': bf16 halves the bytes)")
    parsed = parse_or_serve(ap, serve)
    if parsed is None:
        return
    args, sizes = parsed
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s)/process, "
          f"load avg {os.getloadavg()[0]:.1f}, served dtype {args.dtype} on {args.device}; connect = one-time setup; "
          "push s = median steady push; /memcpy = push / memcpy of the trainer's bytes; "
          "raw/push = raw gloo broadcast time / push; x ckpt = checkpoint round trip / push", flush=True)
    print(HEADER, flush=True)
    rows = []
    for size in sizes:
        rows += bench_size(size, args.transports.split(","), args.pushes, args.threads, args.dtype, args.device,
                           not args.skip_checkpoint)
    print("\n" + HEADER)
    for r in rows:
        print_row(r)
    print(f"load avg {os.getloadavg()[0]:.1f}")
    check(rows)


if __name__ == "__main__":
    main()
