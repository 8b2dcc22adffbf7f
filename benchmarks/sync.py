"""Benchmark weight sync: time per push for shm / dist / http vs memcpy and vs a checkpoint round trip.

    .venv/bin/python benchmarks/sync.py                       # 10m,100m,500m (a few minutes)
    .venv/bin/python benchmarks/sync.py --sizes 10m,100m      # shorter
    .venv/bin/python benchmarks/sync.py --transports shm,http --pushes 2

For each size it builds fp32 random tensors shaped like an SDAR/Qwen3 model (embeddings,
q/k/v/o, gate/up/down, norms, untied lm_head), starts a receiver in ANOTHER process (the
real server.routes_weights + WeightUpdates glue over uvicorn, with a no-op engine), and
from this process times `WeightSender.push` per transport (first push, which builds the
shm region / dist group / staging, and the median of the following pushes). Baselines,
measured in the same run: a same-process memcpy of the same bytes (`Tensor.copy_` into
preallocated tensors) and the checkpoint path (save_file to disk + fsync, then the
receiver loads the file and copies it into its params; the reload hits the page cache).
After timing, the receiver's digest is checked against the sender's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# (vocab, hidden, intermediate, layers): ~10M, ~100M, ~500M parameters
SIZES = {"10m": (8192, 256, 768, 8), "100m": (32000, 768, 2048, 8), "500m": (64000, 1536, 4096, 12)}
TOKEN = "bench"


def sdar_like(size: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Named fp32 tensors with SDAR parameter names and shapes (head_dim 64, kv heads = heads / 2)."""
    vocab, d, inter, layers = SIZES[size]
    g = torch.Generator().manual_seed(seed)
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
    return {n: torch.empty(s).uniform_(-0.05, 0.05, generator=g) for n, s in shapes.items()}


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
def serve(size: str, port: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from safetensors.torch import load_file

    from dllm.weights import copy_into_model
    from server import routes_weights
    from server.weight_updates import make_updates

    class Engine:  # what the routes need; a real server would pause its decode loop here
        version, is_paused = 0, False

        def __init__(self, model: torch.nn.Module):
            self.model = model

        async def pause(self, abort_inflight: bool = False) -> None:
            self.is_paused = True

        async def resume(self) -> None:
            self.is_paused = False

    engine = Engine(module_from(sdar_like(size, seed=1)))
    app = FastAPI()
    app.state.engine, app.state.admin_token = engine, TOKEN
    app.state.weight_updates = make_updates(engine)
    app.include_router(routes_weights.router)

    @app.post("/bench/load_checkpoint")
    def load_checkpoint(body: dict) -> dict:  # the checkpoint path: read file, copy into params
        t0 = time.perf_counter()
        copy_into_model(engine.model, load_file(body["path"]).items())
        return {"load_s": time.perf_counter() - t0}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ---- sender side ---------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_receiver(size: str, threads: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--serve", size, "--port", str(port), "--threads", str(threads)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "receiver process died"
        try:
            httpx.get(url + "/weights/version", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    raise TimeoutError("receiver did not start")


def time_memcpy(named: dict[str, torch.Tensor], repeats: int = 3) -> float:
    dst = {n: torch.empty_like(t) for n, t in named.items()}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n, t in named.items():
            dst[n].copy_(t)
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


def bench_size(size: str, transports: list[str], pushes: int, threads: int) -> list[dict]:
    import httpx

    from weight_sync import WeightSender, weights_digest

    named = sdar_like(size, seed=2)
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    num_params = sum(t.numel() for t in named.values())
    memcpy_s = time_memcpy(named)
    proc, url = start_receiver(size, threads)
    rows = []
    try:
        ckpt_s = time_checkpoint(named, url)
        version = 0
        for transport in transports:
            sender = WeightSender([url], transport=transport, token=TOKEN, timeout=600)
            times = []
            for _ in range(pushes):
                version += 1
                times.append(sender.push(named, version)["total_s"])
            sender.close()
            served = httpx.get(url + "/weights/checksum", headers={"Authorization": f"Bearer {TOKEN}"},
                               timeout=600).json()
            ok = served == {"version": version, "digest": weights_digest(named)}
            steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
            rows.append({"size": size, "params_m": num_params / 1e6, "mb": nbytes / 1e6, "transport": transport,
                         "first_s": times[0], "steady_s": steady, "gbps": nbytes / steady / 1e9,
                         "memcpy_s": memcpy_s, "ckpt_s": ckpt_s, "ok": ok})
            print_row(rows[-1])
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


HEADER = (f"{'size':>5} {'params':>8} {'MB':>7} {'transport':>9} {'first s':>8} {'push s':>8} {'GB/s':>6} "
          f"{'%memcpy':>8} {'memcpy s':>9} {'ckpt s':>7} {'x ckpt':>7} {'digest':>6}")


def print_row(r: dict) -> None:
    print(f"{r['size']:>5} {r['params_m']:>7.1f}M {r['mb']:>7.0f} {r['transport']:>9} {r['first_s']:>8.3f} "
          f"{r['steady_s']:>8.3f} {r['gbps']:>6.2f} {100 * r['memcpy_s'] / r['steady_s']:>7.1f}% "
          f"{r['memcpy_s']:>9.3f} {r['ckpt_s']:>7.2f} {r['ckpt_s'] / r['steady_s']:>6.1f}x "
          f"{'ok' if r['ok'] else 'BAD':>6}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10m,100m,500m", help=f"comma list of {','.join(SIZES)}")
    ap.add_argument("--transports", default="shm,dist,http")
    ap.add_argument("--pushes", type=int, default=3, help="pushes per transport (first + steady)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (sender and receiver share the cores)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.serve:
        return serve(args.serve, args.port)
    sizes = [s.strip().lower() for s in args.sizes.split(",")]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {unknown} (known: {list(SIZES)})")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s)/process, "
          f"load avg {os.getloadavg()[0]:.1f}; "
          "push s = median steady-state push; %memcpy = memcpy time / push time; "
          "x ckpt = checkpoint round trip / push", flush=True)
    print(HEADER, flush=True)
    rows = []
    for size in sizes:
        rows += bench_size(size, args.transports.split(","), args.pushes, args.threads)
    print("\n" + HEADER)
    for r in rows:
        print_row(r)


if __name__ == "__main__":
    main()
