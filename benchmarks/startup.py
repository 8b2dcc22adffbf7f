"""What one `dlrl serve` start costs, per process: this tree against the tree of a git ref, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/startup.py                  # against 0517e4d, 3 starts each
    PYTHONPATH=. .venv/bin/python benchmarks/startup.py --ref HEAD~3 --starts 5 --model tests/fixtures/tiny-sft

Each start runs `python -m dlrl.cli serve` (the default layout: a supervisor, the engine core, one API process)
on the same model folder with one torch thread, waits for /ready, sends one unseeded completion, reads every
process's CPU time (user + system), peak resident memory and whether it mapped libtorch, then stops the
server with SIGTERM. The ref's tree is `git archive`d into a temporary folder and put first on PYTHONPATH, so
both trees run on the same interpreter and packages. Starts alternate between the trees (A B A B ...), so a
change in the machine's load hits both. Printed: the median per process and in total, and the ratios.
The suite starts ~100 servers (tests/README.md), so what a start costs is paid many times by `make test`.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "0517e4d"  # main before the torch-free API processes and the cheaper model building (issue 45)


def tree_of(ref: str) -> Path:
    """The repository's files at `ref` in a temporary folder (git archive)."""
    out = Path(tempfile.mkdtemp(prefix="dlrl-startup-"))
    data = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(out, filter="data")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def role(p: psutil.Process) -> str:
    cmd = p.cmdline()
    return "core" if "core" in cmd else "api" if "api" in cmd else "supervisor"


def one_start(tree: Path, model: str, timeout: float) -> dict[str, dict[str, float]]:
    """Start, wait for /ready, one completion, measure each process, SIGTERM."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dlrl.cli", "serve", f"server.model={model}", f"server.port={port}",
                             "server.device=cpu", "server.log_level=warning"], cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"dlrl serve from {tree} did not become ready")
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        httpx.post(url + "/v1/completions", json={"prompt": "1+1=", "max_tokens": 4}, timeout=60).raise_for_status()
        out: dict[str, dict[str, float]] = {"total": {"ready_s": ready, "cpu_s": 0.0, "rss_mib": 0.0}}
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            cpu = p.cpu_times()
            rss = p.memory_info().rss / 2**20
            torch = float("libtorch" in Path(f"/proc/{p.pid}/maps").read_text())
            out[role(p)] = {"cpu_s": cpu.user + cpu.system, "rss_mib": rss, "torch": torch}
            out["total"]["cpu_s"] += cpu.user + cpu.system
            out["total"]["rss_mib"] += rss
        return out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def median(runs: list[dict[str, dict[str, float]]], who: str, key: str) -> float:
    return statistics.median(r[who][key] for r in runs if who in r and key in r[who])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default=BEFORE, help="the git ref to compare with (default: %(default)s)")
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "tiny-sft"))
    ap.add_argument("--starts", type=int, default=3, help="starts of each tree (median reported)")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    trees = {args.ref: tree_of(args.ref), "this tree": ROOT}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    for _ in range(args.starts):
        for name, tree in trees.items():
            runs[name].append(one_start(tree, args.model, args.timeout))
    before, after = runs[args.ref], runs["this tree"]
    print(f"dlrl serve, one start: median of {args.starts} (CPU s = user + system of the process until after "
          f"/ready and one completion; RSS MiB then)")
    print(f"{'process':<11}{'CPU s ' + args.ref:>16}{'CPU s now':>12}{'ratio':>8}{'RSS ' + args.ref:>14}"
          f"{'RSS now':>10}{'torch then/now':>16}")
    for who in ("supervisor", "core", "api", "total"):
        cb, ca = median(before, who, "cpu_s"), median(after, who, "cpu_s")
        rb, ra = median(before, who, "rss_mib"), median(after, who, "rss_mib")
        torch = "" if who == "total" else f"{'yes' if median(before, who, 'torch') else 'no'}/" \
                                          f"{'yes' if median(after, who, 'torch') else 'no'}"
        print(f"{who:<11}{cb:>16.2f}{ca:>12.2f}{ca / cb:>8.2f}{rb:>14.0f}{ra:>10.0f}{torch:>16}")
    rb, ra = median(before, "total", "ready_s"), median(after, "total", "ready_s")
    print(f"{'ready (s)':<11}{rb:>16.2f}{ra:>12.2f}{ra / rb:>8.2f}")


if __name__ == "__main__":
    main()
