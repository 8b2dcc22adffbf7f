"""Soak test: live mixed traffic against a real `dlrl serve` while weights are pushed into it.

    .venv/bin/python benchmarks/soak.py                       # 64 clients, 10 minutes, a push every 20 s
    .venv/bin/python benchmarks/soak.py --duration 120 --clients 32 --transport http

Starts `dlrl serve --config configs/tiny.yaml` (the trained embedded default if
runs/tiny-sft exists, else random weights of its architecture) as a subprocess, then for
`--duration` seconds (bounded) runs `--clients` closed-loop clients, each sending a random
mix of /v1/completions, /v1/chat/completions (streaming and not) and /generate; 10% of
requests hang up part-way (client disconnect). Meanwhile a pusher calls
`weight_sync.push` every `--push-every` seconds (http and shm alternating by default),
so the engine pauses, applies and resumes under load. Reports: requests by outcome,
errors (anything but 2xx, a 4xx or an intended disconnect; goal 0), p50/p99 latency of
requests that overlapped a push and of those that did not, server RSS after warm-up
and at the end (goal: growth < 10%), KV-cache slots free at the end (goal: all), and
the exit status of the server after SIGTERM (goal: 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm.weights import load_pretrained  # noqa: E402
from weight_sync import push  # noqa: E402
from weight_sync.sender import close_all  # noqa: E402

TOKEN = "soak-token"
KINDS = ["completions", "completions_stream", "chat", "chat_stream", "generate"]


@dataclass
class Stats:
    records: list[tuple[float, float, str, str]] = field(default_factory=list)  # (start, end, kind, outcome)
    pushes: list[tuple[float, float, int, str]] = field(default_factory=list)   # (start, end, version, transport)
    push_errors: list[str] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)


def _model(tmp: Path) -> str:
    """The trained embedded default if present, else random weights with its architecture."""
    from dllm.model import SDARForCausalLM
    from dllm.sft import make_model_config
    from dllm.tiny import load_tiny_sections
    from dllm.tokenizer import build_char_tokenizer
    from dllm.weights import save_pretrained

    arch, _, sft = load_tiny_sections(str(ROOT / "configs/tiny.yaml"))
    trained = ROOT / sft.output_dir
    if (trained / "config.json").is_file():
        return str(trained)
    out = tmp / "tiny-random"
    tok = build_char_tokenizer(out)
    torch.manual_seed(0)
    save_pretrained(SDARForCausalLM(make_model_config(arch, tok)), out)
    return str(out)


def _body(kind: str, rng: random.Random) -> tuple[str, dict]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    common = {"max_tokens": rng.randint(4, 24), "temperature": rng.choice([0.0, 0.7, 1.0]),
              "strategy": rng.choice(["static", "dynamic", "sequential"]), "seed": rng.randint(0, 1 << 30)}
    if rng.random() < 0.2:
        common["stop"] = [str(rng.randint(0, 9))]
    if kind.startswith("completions"):
        return "/v1/completions", {"prompt": f"{a}+{b}=", "stream": kind.endswith("stream"),
                                   "logprobs": rng.choice([None, 2]), **common}
    if kind.startswith("chat"):
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"{a}+{b}"}],
                                        "stream": kind.endswith("stream"), **common}
    return "/generate", {"prompt": [f"{a}+{b}="], "n": rng.choice([1, 2]), **common}


async def _one(client: httpx.AsyncClient, url: str, kind: str, body: dict) -> str:
    """Send one request; returns its outcome ("200", "4xx:<code>", "error:<what>")."""
    if body.get("stream"):
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _status(r.status_code, r.text)
            lines = [line async for line in r.aiter_lines() if line]
            if not lines or lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
                return f"error:bad stream ({lines[-1][:80] if lines else 'empty'})"
            return "200"
    r = await client.post(url, json=body)
    return _status(r.status_code, r.text) if r.status_code != 200 else "200"


def _status(code: int, text: str) -> str:
    return f"4xx:{code}" if 400 <= code < 500 else f"error:{code} {text[:120]}"


async def _client(i: int, base: str, stop_at: float, stats: Stats, disconnect: float) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < stop_at:
            kind = rng.choice(KINDS)
            path, body = _body(kind, rng)
            t0 = time.monotonic()
            hang_up = rng.random() < disconnect
            try:
                if hang_up:
                    await asyncio.wait_for(_one(client, base + path, kind, body), timeout=rng.uniform(0.01, 0.5))
                    outcome = "200"  # finished before the client hung up
                else:
                    outcome = await _one(client, base + path, kind, body)
            except asyncio.TimeoutError:
                outcome = "disconnect"
            except httpx.HTTPError as e:
                outcome = f"error:{type(e).__name__}"
            stats.records.append((t0, time.monotonic(), kind, outcome))


def _pusher(base: str, model_dir: str, transports: list[str], every: float, stop_at: float, stats: Stats) -> None:
    named = list(load_pretrained(model_dir).hf_named_tensors())
    version = 0
    while time.monotonic() + every < stop_at:
        time.sleep(every)
        version += 1
        transport = transports[version % len(transports)]
        t0 = time.monotonic()
        try:
            push([base], named, version=version, transport=transport, token=TOKEN, timeout=120)
        except Exception as e:  # reported, never fatal
            stats.push_errors.append(f"v{version} {transport}: {e}")
        stats.pushes.append((t0, time.monotonic(), version, transport))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _sample_rss(pid: int, stats: Stats, stop: threading.Event) -> None:
    while not stop.wait(5.0):
        stats.rss.append((time.monotonic(), _rss(pid)))


def _percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return f"n={len(values)}"
    q = statistics.quantiles(values, n=100)
    return f"n={len(values)} p50={q[49]:.2f}s p99={q[98]:.2f}s"


def _overlaps(rec: tuple, pushes: list[tuple]) -> bool:
    return any(rec[0] < p_end and p_start < rec[1] for p_start, p_end, _, _ in pushes)


def report(stats: Stats, t_start: float, warmup_end: float, end_rss: int, health: dict, exit_code: int | None) -> dict:
    outcomes: dict[str, int] = {}
    for *_, outcome in stats.records:
        key = outcome if not outcome.startswith("error:") else "error"
        outcomes[key] = outcomes.get(key, 0) + 1
    errors = [r[3] for r in stats.records if r[3].startswith("error:")]
    done = [r for r in stats.records if r[3] == "200"]
    during = [r[1] - r[0] for r in done if _overlaps(r, stats.pushes)]
    without = [r[1] - r[0] for r in done if not _overlaps(r, stats.pushes)]
    warm = [rss for t, rss in stats.rss if t >= warmup_end]
    start_rss = warm[0] if warm else end_rss
    push_s = [p[1] - p[0] for p in stats.pushes]
    out = {
        "duration_s": round(time.monotonic() - t_start, 1), "requests": len(stats.records), "outcomes": outcomes,
        "errors": len(errors), "error_examples": sorted(set(errors))[:5],
        "latency_with_push": _percentiles(during), "latency_without_push": _percentiles(without),
        "pushes": len(stats.pushes), "push_errors": stats.push_errors[:5],
        "push_seconds": _percentiles(push_s),
        "rss_after_warmup_mb": round(start_rss / 2**20, 1), "rss_end_mb": round(end_rss / 2**20, 1),
        "rss_growth_pct": round(100 * (end_rss - start_rss) / max(start_rss, 1), 1),
        "rss_max_mb": round(max((r for _, r in stats.rss), default=end_rss) / 2**20, 1),
        "kv_slots_free_end": f"{health.get('num_free_slots')}/{health.get('max_batch')}",
        "running_end": health.get("num_running"), "waiting_end": health.get("num_waiting"),
        "server_exit_code_after_sigterm": exit_code,
    }
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model_dir: str, port: int, log_path: Path, max_batch: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.cli", "--config", str(ROOT / "configs/tiny.yaml"), "--model", model_dir,
           "--port", str(port), f"server.max_batch={max_batch}", "server.admin_token_file=",
           "server.log_level=warning", "server.shutdown_timeout=30"]
    env = {**os.environ, "DLRL_ADMIN_TOKEN": TOKEN}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log_path.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server not ready after 120 s")


async def _traffic(base: str, args: argparse.Namespace, stop_at: float, stats: Stats) -> None:
    await asyncio.gather(*(_client(i, base, stop_at, stats, args.disconnect) for i in range(args.clients)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (bounded)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--push-every", type=float, default=20.0)
    p.add_argument("--transport", choices=["http", "shm", "both"], default="both")
    p.add_argument("--disconnect", type=float, default=0.1, help="fraction of requests the client abandons")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--warmup", type=float, default=30.0, help="RSS growth is measured from this point on")
    p.add_argument("--json", default="", help="also write the report here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model(Path(tmp))
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        proc = _start_server(model_dir, port, Path(tmp) / "server.log", args.max_batch)
        stats = Stats()
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(proc.pid, stats, stop), daemon=True)
        sampler.start()
        t_start = time.monotonic()
        stop_at = t_start + args.duration
        transports = ["http", "shm"] if args.transport == "both" else [args.transport]
        pusher = threading.Thread(target=_pusher, args=(base, model_dir, transports, args.push_every, stop_at, stats),
                                  daemon=True)
        pusher.start()
        print(f"soak: {args.clients} clients for {args.duration:.0f}s against {base} ({model_dir}), "
              f"push every {args.push_every:.0f}s over {'/'.join(transports)}", flush=True)
        try:
            asyncio.run(_traffic(base, args, stop_at, stats))
            pusher.join(timeout=180)
            close_all()  # the pusher's cached senders (shm region, http clients)
            deadline = time.monotonic() + 60
            health = httpx.get(base + "/health", timeout=10).json()
            while health["num_running"] or health["num_waiting"]:  # disconnected sequences are released
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
                health = httpx.get(base + "/health", timeout=10).json()
            health["max_batch"] = args.max_batch
            end_rss = _rss(proc.pid)
        finally:
            stop.set()
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_code = None
        result = report(stats, t_start, t_start + args.warmup, end_rss, health, exit_code)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
