"""RL step benchmark: per-step time breakdown, in-place weight sync vs the checkpoint path.

    .venv/bin/python benchmarks/step.py                 # tiny default + ~100M random SDAR
    .venv/bin/python benchmarks/step.py --models tiny   # quicker

For each model: start a real `dlrl serve` process, run a few real `dlrl train` steps
against it (DeepSpeed ZeRO-0 on CPU, TraceRL, shm push), and read the per-phase times
from metrics.jsonl. Then, in the same run, time the path in-place sync replaces: save
the policy as safetensors + start a fresh server from that checkpoint until /ready
(what recipes that restart the sampler every step pay), and report both as a share of
the step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKEN = "bench-token"
PHASES = ("rollout", "reward", "replay", "train", "sync")


def parity_reward(text: str, example: dict) -> float:
    """Reward with variance for random models (so no group is filtered out)."""
    return float(zlib.crc32(text.encode()) % 2)


def make_model(name: str, out: Path) -> Path:
    from dllm.embedded.sft import TinyModelConfig
    from dllm.embedded.tiny import random_tiny_folder

    sft = ROOT / "runs" / "tiny-sft"
    if name == "tiny" and (sft / "config.json").is_file():
        return sft
    arch = TinyModelConfig() if name == "tiny" else TinyModelConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64)
    return Path(random_tiny_folder(out, arch))


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dlrl.cli", "serve", "--model", str(model), "--port", str(port),
                             "server.device=cpu", "server.dtype=float32", "server.max_batch=64"],
                            env=dict(os.environ, DLRL_ADMIN_TOKEN=TOKEN), stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, cwd=ROOT)


def run_steps(model: Path, url: str, work: Path, steps: int, prompts: int) -> list[dict]:
    from trainer.cli import main

    cfg = {"train": {"servers": [url], "model": str(model), "output_dir": str(work / "run"), "num_steps": steps,
                     "prompts_per_step": prompts, "group_size": 8, "max_tokens": 8, "eval_every": 0,
                     "reward": f"{Path(__file__).resolve()}:parity_reward", "admin_token": TOKEN,
                     "start_server": False, "tensorboard": False, "lr": 1e-5}}
    (work / "cfg.yaml").write_text(json.dumps(cfg))
    if main(["--config", str(work / "cfg.yaml")]) != 0:
        raise SystemExit("training failed")
    return [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]


def wait_ready(url: str, timeout: float, proc: subprocess.Popen) -> None:
    """Until the server at `url` answers /ready (SystemExit naming its log if it exits first)."""
    from rollout_client.client import RolloutClient

    async def ready_once() -> bool:
        async with RolloutClient([url]) as client:
            return await client.is_ready(url)

    deadline = time.monotonic() + timeout
    while not asyncio.run(ready_once()):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise SystemExit(f"server {url} not ready after {timeout:.0f}s")
        time.sleep(0.5)


def checkpoint_path(final: Path, work: Path) -> tuple[float, float]:
    """-> (save seconds, fresh-server-until-ready seconds) for the exported policy."""
    from dllm.weights import load_pretrained, save_pretrained
    model = load_pretrained(final)
    ckpt = work / "ckpt"
    t0 = time.perf_counter()
    save_pretrained(model, ckpt)
    for f in final.glob("tokenizer*"):
        shutil.copy(f, ckpt / f.name)
    with open(ckpt / "model.safetensors", "rb") as fh:
        os.fsync(fh.fileno())
    save_s = time.perf_counter() - t0
    port = free_port()
    t1 = time.perf_counter()
    proc = start_server(ckpt, port, work / "reload.log")
    try:
        wait_ready(f"http://127.0.0.1:{port}", 600, proc)
        return save_s, time.perf_counter() - t1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bench(name: str, steps: int, prompts: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"dlrl-step-{name}-"))
    model = make_model(name, work / "model")
    port = free_port()
    proc = start_server(model, port, work / "server.log")
    try:
        wait_ready(f"http://127.0.0.1:{port}", 600, proc)
        rows = run_steps(model, f"http://127.0.0.1:{port}", work, steps, prompts)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    timed = rows[1:] if len(rows) > 1 else rows  # the first step warms up
    phase = {p: statistics.mean(r.get(f"time_{p}", 0.0) for r in timed) for p in PHASES}
    step_s = sum(phase.values())
    save_s, reload_s = checkpoint_path(work / "run" / "final", work)
    shutil.rmtree(work, ignore_errors=True)
    return {"model": name, "steps": len(timed), "phase": phase, "step_s": step_s, "save_s": save_s,
            "reload_s": reload_s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    results = [bench(m, args.steps, 16 if m == "tiny" else 4) for m in args.models.split(",")]
    print("\n## RL step time breakdown (mean per step, seconds; 1 warm-up step excluded)")
    print("| model | " + " | ".join(PHASES) + " | step | sync share |")
    print("|---|" + "---:|" * (len(PHASES) + 2))
    for r in results:
        cells = " | ".join(f"{r['phase'][p]:.3f}" for p in PHASES)
        print(f"| {r['model']} | {cells} | {r['step_s']:.2f} | {100 * r['phase']['sync'] / r['step_s']:.1f}% |")
    print("\n## In-place sync vs checkpoint save + fresh server from the checkpoint")
    print("| model | in-place sync s | save s | reload-until-ready s | checkpoint path s | ratio | "
          "checkpoint share of a step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ck = r["save_s"] + r["reload_s"]
        share = ck / (r["step_s"] - r["phase"]["sync"] + ck)
        print(f"| {r['model']} | {r['phase']['sync']:.3f} | {r['save_s']:.2f} | {r['reload_s']:.2f} | {ck:.2f} | "
              f"{ck / max(r['phase']['sync'], 1e-9):.0f}x | {100 * share:.1f}% |")


if __name__ == "__main__":
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    main()
