"""Slow-header flood against `dlrl serve` with and without the connection bounds, side by side (issue 28).

    .venv/bin/python benchmarks/flood.py [--sockets 600] [--seconds 8] [--nofile 512]

Starts a server on a tiny random SDAR model twice, each with a file limit of `--nofile`
descriptors (RLIMIT_NOFILE set in the child): once as uvicorn serves the app by default
(no header timeout, no caps: what `dlrl serve` did before issue 28), once as `dlrl serve`
does now (server/api/connections.py, default bounds but a 2 s header timeout). Each faces
`--sockets` connections from 127.0.0.2 that send their request headers one byte per
second for `--seconds`, while /health is probed from 127.0.0.1 every 0.1 s (1 s timeout).
Prints, per mode: /health answered, its p50 / p99 latency, the slow sockets the server
closed, the log's lines and bytes, and its "out of system resource" lines.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
UNBOUNDED = '''
import sys, uvicorn
from server.cli import build_engine
from server.config import ServerConfig
from server.api.app import create_app
model, port = sys.argv[1], int(sys.argv[2])
config = ServerConfig(model=model, port=port, device="cpu", dtype="float32", max_batch=2, max_model_len=64)
app = create_app(build_engine(config, model), config)
uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info")).run()
'''


def tiny_model(path: Path) -> str:
    from dllm.embedded.tiny import SMALL_ARCH, random_tiny_folder

    return random_tiny_folder(path, **SMALL_ARCH)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(mode: str, model: str, nofile: int, log_path: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    if mode == "unbounded":
        cmd = [sys.executable, "-c", UNBOUNDED, model, str(port)]
    else:
        cmd = [sys.executable, "-m", "server.cli", "--model", model, "--port", str(port), "server.device=cpu",
               "server.dtype=float32", "server.max_batch=2", "server.max_model_len=64", "server.header_timeout_s=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{mode} server did not start: {log_path.read_text()[-2000:]}")


def flood(port: int, num: int, seconds: float) -> tuple[int, int]:
    """`num` sockets dribbling headers for `seconds`; returns (connected, closed by the server)."""
    socks, closed = [], 0
    for _ in range(num):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.settimeout(0.5)
        try:
            s.connect(("127.0.0.1", port))
            socks.append(s)
        except OSError:
            s.close()
    header = b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000
    deadline, k = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        for s in socks:
            if s.fileno() < 0:
                continue
            try:
                s.send(header[k : k + 1])
            except OSError:
                closed += 1
                s.close()
        k += 1
        time.sleep(1.0)
    for s in socks:
        s.close()
    return len(socks), closed


def probe(port: int, seconds: float) -> list[float | None]:
    out: list[float | None] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            ok = False
        out.append(time.perf_counter() - t0 if ok else None)
        time.sleep(0.1)
    return out


def run(mode: str, model: str, args: argparse.Namespace, tmp: Path) -> dict:
    log_path = tmp / f"{mode}.log"
    proc, port = start(mode, model, args.nofile, log_path)
    try:
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(zip(("connected", "closed"),
                                                              flood(port, args.sockets, args.seconds))))
        t.start()
        time.sleep(0.5)
        latencies = probe(port, args.seconds - 0.5)
        t.join()
    finally:
        proc.kill()
        proc.wait()
    ok = sorted(x for x in latencies if x is not None)
    text = log_path.read_text(errors="replace")
    return {"mode": mode, "health_ok": f"{len(ok)}/{len(latencies)}",
            "p50_ms": round(1000 * statistics.median(ok), 1) if ok else None,
            "p99_ms": round(1000 * ok[min(len(ok) - 1, int(0.99 * len(ok)))], 1) if ok else None,
            **result, "log_lines": text.count("\n"), "log_bytes": len(text.encode()),
            "resource_error_lines": text.count("out of system resource")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sockets", type=int, default=600)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--nofile", type=int, default=512)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = tiny_model(tmp / "model")
        rows = [run(mode, model, args, tmp) for mode in ("unbounded", "bounded")]
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row.get(k)) for k in keys))


if __name__ == "__main__":
    main()
