"""Issue 46, the engine in its own process: `dlrl serve` layouts side by side in one run (run through flood.py).

    .venv/bin/python benchmarks/flood.py split  [--seconds 20] [--conns 64] [--layouts main,thread,process]
    .venv/bin/python benchmarks/flood.py stream [--stream-clients 256] [--requests 2] [--max-tokens 32] [--layouts ...]

Layouts: `process` = `dlrl serve` as it runs by default (the engine core in its own process, one API
process); `thread` = `server.engine_core=thread` (one process, the core on a thread, same channel);
`main` = the code at `--baseline-root` (default /work/main: today's one-process server, before this
branch), started the same way. Every server serves a tiny random SDAR model (CPU, one torch thread).

`split`: a server of `max_batch` 4 with two API keys. The polite key sends short completions (POST
/generate, 8 tokens) one at a time, back to back, for `--seconds` alone, then while the flooding key
(quota 1 request/s) sends from `--conns` keep-alive connections in a closed loop (each sends again as
soon as it is answered: a raw-socket client in its own process). Per phase: the polite key's p50 /
p95, the engine's mean step wall time (`dlrl_step_seconds` from /metrics before and after), the
server's CPU (its whole process tree), and in the flood the refusals per second. Goals: polite p95
flood / alone <= 3x; step time flood / alone <= 1.2x; refusals/s at least the `main` layout's.

`stream`: `--stream-clients` concurrent clients (asyncio, raw sockets, one process) each send `--requests`
streaming POST /v1/completions one after the other (`--max-tokens` tokens, ignore_eos) to a server
of `max_batch` 64: completion tokens per second (from the usage chunk), time to first token (the
first chunk after the opening one) p50 / p99, all requests answered 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from benchmarks.flood import (
    FLOODER,
    POLITE,
    ROOT,
    KeepAlive,
    _start,
    free_port,
    ms,
    percentile,
    print_rows,
    raw_post,
)

LAYOUTS = ("main", "thread", "process")


def start_layout(layout: str, model: str, log_path: Path, overrides: list[str],
                 baseline_root: str) -> tuple[object, str]:
    """`dlrl serve` of `layout` (see the module doc); (process, url) once /health answers."""
    port = free_port()
    root = baseline_root if layout == "main" else str(ROOT)
    extra = [] if layout == "main" else [f"server.engine_core={layout}"]
    cmd = [sys.executable, "-m", "server.cli", "--model", model, "--port", str(port), "server.device=cpu",
           "server.dtype=float32", *overrides, *extra]
    return _start(cmd, port, log_path, None, {"PYTHONPATH": root}, cwd=root)


def tree_cpu(proc: object) -> float:
    """User + system CPU seconds of a process and its children so far."""
    root = psutil.Process(proc.pid)  # type: ignore[attr-defined]
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def step_stats(url: str) -> tuple[float, float]:
    """(sum, count) of dlrl_step_seconds."""
    out = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for key in out:
            if line.startswith(f"dlrl_step_seconds_{key}"):
                out[key] = float(line.split()[-1])
    return out["sum"], out["count"]


def polite_closed(url: str, seconds: float) -> tuple[list[float], int]:
    """The polite key's requests back to back for `seconds`: (latencies of the 200s, other answers)."""
    latencies, others = [], 0
    body = {"prompt": "1+1=", "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {POLITE}"}, timeout=60) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            r = client.post("/generate", json=body)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                others += 1
    return latencies, others


async def _closed_conn(port: int, request: bytes, deadline: float, counts: Counter) -> None:
    """One keep-alive connection sending `request` again as soon as it is answered."""
    conn = KeepAlive(port)
    while time.monotonic() < deadline:
        if not await conn.send(request, counts):
            await asyncio.sleep(0.01)
    conn.close()


def _closed_flood(port: int, request: bytes, conns: int, seconds: float, out: multiprocessing.Queue) -> None:
    async def main() -> Counter:
        counts: Counter = Counter()
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_closed_conn(port, request, deadline, counts) for _ in range(conns)))
        return counts

    out.put(dict(asyncio.run(main())))


def split_layout(layout: str, args: argparse.Namespace, tmp: Path, model: str) -> dict:
    keys = tmp / "split-keys.yaml"
    keys.write_text(json.dumps({"keys": {"polite": {"key": POLITE, "requests_per_s": 1000},
                                         "flooder": {"key": FLOODER, "requests_per_s": 1}}}))
    proc, url = start_layout(layout, model, tmp / f"split-{layout}.log",
                             ["server.max_batch=4", "server.max_model_len=64", f"server.api_keys_file={keys}",
                              "server.log_level=warning"], args.baseline_root)
    port = int(url.rsplit(":", 1)[1])
    row: dict = {"layout": layout}
    try:
        polite_closed(url, 3)  # warm-up
        for phase in ("alone", "flood"):
            flood = None
            if phase == "flood":
                ctx = multiprocessing.get_context("spawn")
                q: multiprocessing.Queue = ctx.Queue()
                flood = ctx.Process(target=_closed_flood, args=(port, raw_post("/generate", FLOODER, {
                    "prompt": "1+1=", "max_tokens": 8}), args.conns, args.seconds + 1.0, q), daemon=True)
                flood.start()
                time.sleep(1.0)  # the flood runs before the window opens
            (s0, n0), c0, t0 = step_stats(url), tree_cpu(proc), time.monotonic()
            lat, others = polite_closed(url, args.seconds - (0.5 if flood else 0))
            (s1, n1), c1, t1 = step_stats(url), tree_cpu(proc), time.monotonic()
            row[f"p50_{phase}_ms"], row[f"p95_{phase}_ms"] = ms(percentile(lat, 0.5)), ms(percentile(lat, 0.95))
            row[f"polite_n_{phase}"] = len(lat) + others
            row[f"step_{phase}_ms"] = round(1000 * (s1 - s0) / max(n1 - n0, 1), 2)
            row[f"cpu_{phase}_per_s"] = round((c1 - c0) / (t1 - t0), 2)
            if flood is not None:
                counts = q.get(timeout=120)
                flood.join()
                row["refused_per_s"] = round(counts.get(429, 0) / (args.seconds + 1.0))
                row["flood_answers"] = dict(counts)
    finally:
        proc.terminate()  # type: ignore[attr-defined]
        proc.wait(60)  # type: ignore[attr-defined]
    row["p95_ratio"] = round(row["p95_flood_ms"] / row["p95_alone_ms"], 2)
    row["step_ratio"] = round(row["step_flood_ms"] / max(row["step_alone_ms"], 1e-9), 2)
    return row


def split(args: argparse.Namespace, tmp: Path, model: str) -> None:
    rows = [split_layout(layout, args, tmp, model) for layout in args.layouts.split(",")]
    for row in rows:
        print(json.dumps(row))
    print_rows(f"closed-loop flood ({args.conns} connections, one key over its quota) vs a polite key one request at "
               "a time; max_batch 4 (goals: p95 ratio <= 3, step ratio <= 1.2, refusals/s >= main's)",
               [{k: v for k, v in r.items() if k != "flood_answers"} for r in rows])


# ---------------------------------------------------------------------------------------------- stream
async def _stream_one(port: int, request: bytes) -> tuple[int, float | None, int, float]:
    """(status, seconds to the first token, completion tokens, seconds in all) of one streaming request."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        ttft, tokens, events, buf = None, 0, 0, b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                break
            buf += await reader.readexactly(size + 2)
            *done, buf = buf.replace(b"\r\n", b"").split(b"\n\n")
            for event in done:
                events += 1
                if events == 2 and ttft is None:
                    ttft = time.perf_counter() - t0
                if b'"usage":{' in event:
                    tokens = json.loads(event[6:])["usage"]["completion_tokens"]
        return status, ttft, tokens, time.perf_counter() - t0
    finally:
        writer.close()


def _stream_clients(port: int, clients: int, requests: int, max_tokens: int, out: multiprocessing.Queue) -> None:
    body = {"prompt": "1+1=", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    data = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode() + data

    async def client() -> list[tuple[int, float | None, int, float]]:
        return [await _stream_one(port, request) for _ in range(requests)]

    async def main() -> tuple[list, float]:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client() for _ in range(clients)))
        return [r for rs in results for r in rs], time.perf_counter() - t0

    out.put(asyncio.run(main()))


def stream_layout(layout: str, args: argparse.Namespace, tmp: Path, model: str) -> dict:
    proc, url = start_layout(layout, model, tmp / f"stream-{layout}.log",
                             ["server.max_batch=64", "server.max_queue=512", "server.max_model_len=128",
                              "server.log_level=warning", "server.max_connections_per_ip=1024"], args.baseline_root)
    port = int(url.rsplit(":", 1)[1])
    try:
        ctx = multiprocessing.get_context("spawn")
        q: multiprocessing.Queue = ctx.Queue()
        warm = ctx.Process(target=_stream_clients, args=(port, 16, 1, args.max_tokens, q), daemon=True)
        warm.start()
        q.get(timeout=600)
        warm.join()
        c0 = tree_cpu(proc)
        p = ctx.Process(target=_stream_clients, args=(port, args.clients, args.requests, args.max_tokens, q),
                        daemon=True)
        p.start()
        results, wall = q.get(timeout=1800)
        p.join()
        cpu = tree_cpu(proc) - c0
    finally:
        proc.terminate()  # type: ignore[attr-defined]
        proc.wait(60)  # type: ignore[attr-defined]
    ok = [r for r in results if r[0] == 200]
    ttfts = [r[1] for r in ok if r[1] is not None]
    tokens = sum(r[2] for r in ok)
    return {"layout": layout, "requests_ok": f"{len(ok)}/{len(results)}", "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": ms(percentile(ttfts, 0.5)), "ttft_p99_ms": ms(percentile(ttfts, 0.99)),
            "latency_p50_s": round(statistics.median(r[3] for r in ok), 2) if ok else None,
            "wall_s": round(wall, 1), "server_cpu_s": round(cpu, 1)}


def stream(args: argparse.Namespace, tmp: Path, model: str) -> None:
    rows = [stream_layout(layout, args, tmp, model) for layout in args.layouts.split(",")]
    print_rows(f"{args.clients} concurrent streaming clients x {args.requests} requests of {args.max_tokens} tokens "
               "(max_batch 64)", rows)


__all__ = ["LAYOUTS", "split", "start_layout", "stream", "tree_cpu"]
