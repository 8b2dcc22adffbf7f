"""Floods against real `dlrl serve` processes, each measured side by side in one run (issues 28, 37, 46).

    .venv/bin/python benchmarks/flood.py headers [--sockets 600] [--seconds 8] [--nofile 512]
    .venv/bin/python benchmarks/flood.py keys [--seconds 20] [--rate 400] [--conns 32] [--protocols h11,httptools]
    .venv/bin/python benchmarks/flood.py retry [--clients 48] [--bursts 3] [--max-queue 8] [--lengths 16,384]
    .venv/bin/python benchmarks/flood.py store [--posts 48] [--seconds 12]
    .venv/bin/python benchmarks/flood.py split [--seconds 20] [--conns 64] [--layouts main,thread,process]
    .venv/bin/python benchmarks/flood.py stream [--stream-clients 256] [--requests 2] [--layouts main,thread,process]
    .venv/bin/python benchmarks/flood.py all          # keys, retry and store, one after the other

`split` and `stream` (issue 46: the engine core in its own process vs one process): benchmarks/flood_split.py.

Every server serves a tiny random SDAR model (CPU, one torch thread).

`headers` (issue 28): a slow-header flood with and without the connection bounds. The server
runs twice with a file limit of `--nofile` descriptors: once as uvicorn serves the app by
default (no header timeout, no caps), once as `dlrl serve` does (server/api/connections.py, a 2 s
header timeout). Each faces `--sockets` connections from 127.0.0.2 that send their headers one
byte per second while /health is probed from 127.0.0.1 every 0.1 s. Prints, per mode: /health
answered, its p50 / p99, the slow sockets the server closed, the log's lines and bytes.

`keys` (issue 37): for each of `--protocols` (a server with server.http=h11 + server.loop=asyncio,
then one with httptools + uvloop, the default when installed), a polite key (5 requests/s of
POST /generate, 8 tokens, well within its quota) alone for `--seconds`, then with a flooding key sending `--rate` requests/s (over `--conns`
keep-alive connections, a raw-socket client in its own process) against a quota of 1 request/s,
then alone again. Prints the polite key's p50 / p95 / p99 per phase, the flood's answers and
rate, and the server process's CPU per refused request: (server CPU in the flood phase - server
CPU in the quiet phases, per second) x seconds / refusals; then a table of both protocols side by
side. Goals: polite p95 with the flood <= 2x without; <= 0.3 ms CPU per refusal. Then the floor:
the CPU per request of uvicorn alone (a one-route ASGI app answering 429) under the same flood,
with h11 + asyncio, and with httptools + uvloop when installed (the server extra) or given
`--floor-path DIR` (`pip install --target DIR httptools uvloop`; only the floor's process gets DIR).

`retry` (issues 37, 46): saturating bursts, for each of `--lengths` (tokens per request). `--clients`
clients send POST /generate (one sequence of that many tokens, ignore_eos) at the same instant to a
server (`--layout`, see flood_split.py) of 4 slots and `--max-queue` waiting sequences; a client refused 429
sleeps exactly its Retry-After and sends the same request
again, until admitted; `--bursts` bursts one after the other. Prints, per burst, the Retry-After
values seen (and the first refusal of each client, in time order: they grow with the queue),
the share of retries made at Retry-After that were admitted (goal: >= 70 %), and how long
refused clients took to get in.

`store` (issue 37): recording into a throwaway PostgreSQL server (tests/postgres.py), killed
(`pg_ctl stop -m immediate`) while `--posts` clients post feedback in a loop; meanwhile the
admin `GET /weights/checksum` is timed every 0.5 s, for `--seconds` before and during the outage. Prints its p50 / max per phase (goal:
<= 1 s while the store is down) and the feedback answers.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ADMIN, FEEDBACK = "flood-admin-token", "flood-feedback-token"
POLITE, FLOODER = "sk-polite-0123456789abcdef", "sk-flooder-0123456789abcdef"
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


FLOOR = '''
import sys, uvicorn
body = b'{"error": {"message": "over quota", "type": "rate_limit_error", "param": null, "code": 429}}'
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    status = 200 if scope["path"] == "/health" else 429
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False, http=sys.argv[2],
            loop=sys.argv[3])
'''


def tiny_model(path: Path) -> str:
    from dllm.embedded.tiny import SMALL_ARCH, random_tiny_folder

    return random_tiny_folder(path, **SMALL_ARCH)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def serve(model: str, log_path: Path, *overrides: str, nofile: int | None = None,
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start `dlrl serve` on `model` with `overrides`; return (process, url) once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "--model", model, "--port", str(port), "server.device=cpu",
           "server.dtype=float32", *overrides]
    return _start(cmd, port, log_path, nofile, env)


def _start(cmd: list[str], port: int, log_path: Path, nofile: int | None,
           env: dict[str, str] | None = None, cwd: str | Path = ROOT) -> tuple[subprocess.Popen, str]:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    out = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, preexec_fn=limit)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start: {log_path.read_text()[-2000:]}")


def cpu_s(proc: subprocess.Popen) -> tuple[float, float]:
    """(user, system) CPU seconds of the process so far."""
    t = psutil.Process(proc.pid).cpu_times()
    return t.user, t.system


# ---------------------------------------------------------------------------------------------- headers (issue 28)
def dribble(port: int, num: int, seconds: float) -> tuple[int, int]:
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


def probe(url: str, seconds: float) -> list[float | None]:
    out: list[float | None] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            ok = httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            ok = False
        out.append(time.perf_counter() - t0 if ok else None)
        time.sleep(0.1)
    return out


def headers_mode(mode: str, model: str, args: argparse.Namespace, tmp: Path) -> dict:
    log_path = tmp / f"{mode}.log"
    if mode == "unbounded":
        port = free_port()
        proc, url = _start([sys.executable, "-c", UNBOUNDED, model, str(port)], port, log_path, args.nofile)
    else:
        proc, url = serve(model, log_path, "server.max_batch=2", "server.max_model_len=64",
                          "server.header_timeout_s=2", nofile=args.nofile)
    port = int(url.rsplit(":", 1)[1])
    try:
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(zip(("connected", "closed"),
                                                              dribble(port, args.sockets, args.seconds))))
        t.start()
        time.sleep(0.5)
        latencies = probe(url, args.seconds - 0.5)
        t.join()
    finally:
        proc.kill()
        proc.wait()
    ok = sorted(x for x in latencies if x is not None)
    text = log_path.read_text(errors="replace")
    return {"mode": mode, "health_ok": f"{len(ok)}/{len(latencies)}", "p50_ms": ms(percentile(ok, 0.5)),
            "p99_ms": ms(percentile(ok, 0.99)), **result, "log_lines": text.count("\n"),
            "log_bytes": len(text.encode()), "resource_error_lines": text.count("out of system resource")}


def headers(args: argparse.Namespace, tmp: Path, model: str) -> None:
    rows = [headers_mode(mode, model, args, tmp) for mode in ("unbounded", "bounded")]
    print_rows("slow-header flood (issue 28)", rows)


# ---------------------------------------------------------------------------------------------- raw flood client
def raw_post(path: str, key: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n").encode() + data


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    await reader.readexactly(int(fields.get(b"content-length", b"0")))
    return status, fields


class KeepAlive:
    """One keep-alive connection to 127.0.0.1:`port` (a raw-socket HTTP/1.1 client), opened on first use and
    again after the server closed it or an exchange failed."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, request: bytes, counts: Counter) -> bool:
        """Send `request`, read its answer and count its status (or "error": False)."""
        try:
            if self.reader is None or self.writer is None:
                self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
            self.writer.write(request)
            status, fields = await _read_response(self.reader)
            counts[status] += 1
            if fields.get(b"connection", b"").lower() == b"close":
                self.close()
            return True
        except (OSError, asyncio.IncompleteReadError, ValueError):
            counts["error"] += 1
            self.close()
            return False

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _flood_conn(port: int, request: bytes, start: float, period: float, deadline: float,
                      counts: Counter) -> None:
    """One keep-alive connection sending `request` every `period` seconds (reconnecting when closed)."""
    conn = KeepAlive(port)
    k = 0
    while True:
        due = start + k * period
        now = time.monotonic()
        if due >= deadline:
            break
        if due > now:
            await asyncio.sleep(due - now)
        k += 1
        await conn.send(request, counts)
    conn.close()


def _flood_process(port: int, request: bytes, rate: float, conns: int, seconds: float, out: multiprocessing.Queue) -> None:
    async def main() -> Counter:
        counts: Counter = Counter()
        start = time.monotonic() + 0.2
        period = conns / rate
        await asyncio.gather(*(_flood_conn(port, request, start + i * period / conns, period, start + seconds, counts)
                               for i in range(conns)))
        return counts

    out.put(dict(asyncio.run(main())))


def start_flood(port: int, request: bytes, rate: float, conns: int,
                seconds: float) -> tuple[multiprocessing.Process, multiprocessing.Queue]:
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    proc = ctx.Process(target=_flood_process, args=(port, request, rate, conns, seconds, out), daemon=True)
    proc.start()
    return proc, out


# ---------------------------------------------------------------------------------------------- keys (issue 37)
def polite_load(url: str, seconds: float, rate: float) -> list[float]:
    """POST /generate as the polite key every 1/rate s for `seconds`; latencies of the 200s."""
    out = []
    body = {"prompt": "1+1=", "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {POLITE}"}, timeout=30) as client:
        t_next, deadline = time.monotonic(), time.monotonic() + seconds
        while t_next < deadline:
            time.sleep(max(0.0, t_next - time.monotonic()))
            t0 = time.perf_counter()
            r = client.post("/generate", json=body)
            if r.status_code == 200:
                out.append(time.perf_counter() - t0)
            t_next += 1.0 / rate
    return out


PROTOCOLS = {"h11": ("h11", "asyncio"), "httptools": ("httptools", "uvloop")}  # --protocols: server.http, server.loop


def keys(args: argparse.Namespace, tmp: Path, model: str) -> None:
    summary = [keys_protocol(name, args, tmp, model) for name in args.protocols.split(",")]
    print_rows("side by side: CPU per refusal and the polite key's p95, per HTTP protocol (goals <= 0.3 ms, <= 2x)",
               summary)
    floors(args, tmp)


def keys_protocol(name: str, args: argparse.Namespace, tmp: Path, model: str) -> dict:
    """The three phases against one `dlrl serve` with server.http / server.loop of PROTOCOLS[name]; its summary row."""
    http, loop = PROTOCOLS[name]
    keys_file = tmp / "keys.yaml"
    keys_file.write_text(json.dumps({"keys": {"polite": {"key": POLITE, "requests_per_s": 50},
                                              "flooder": {"key": FLOODER, "requests_per_s": 1}}}))
    proc, url = serve(model, tmp / f"keys-{name}.log", "server.max_batch=8", "server.max_model_len=64",
                      f"server.api_keys_file={keys_file}", f"server.log_level={args.log_level}",
                      f"server.http={http}", f"server.loop={loop}")
    port = int(url.rsplit(":", 1)[1])
    rows, flood_counts = [], {}
    try:
        polite_load(url, 3, args.polite_rate)  # warm-up
        for phase in ("quiet", "flood", "quiet again"):
            flood = start_flood(port, raw_post("/generate", FLOODER, {"prompt": "1+1=", "max_tokens": 8}), args.rate,
                                args.conns, args.seconds) if phase == "flood" else None
            if flood is not None:
                time.sleep(1.0)  # the flooding process starts (spawn) before the window opens
            c0, t0 = cpu_s(proc), time.monotonic()
            lat = polite_load(url, args.seconds - (1.5 if flood else 0), args.polite_rate)
            c1, t1 = cpu_s(proc), time.monotonic()
            if flood is not None:
                flood_counts = flood[1].get(timeout=60)
                flood[0].join()
            rows.append({"phase": phase, "polite_n": len(lat), "p50_ms": ms(percentile(lat, 0.5)),
                         "p95_ms": ms(percentile(lat, 0.95)), "p99_ms": ms(percentile(lat, 0.99)),
                         "server_cpu_s": round(c1[0] + c1[1] - c0[0] - c0[1], 2),
                         "of_which_system_s": round(c1[1] - c0[1], 2), "window_s": round(t1 - t0, 2)})
    finally:
        proc.terminate()
        proc.wait(30)
    print_rows(f"{http} + {loop}: polite key with and without a flooding key ({args.rate:g} req/s over "
               f"{args.conns} connections)", rows)
    refused = sum(v for k, v in flood_counts.items() if k == 429)
    quiet_cpu_per_s = statistics.mean(r["server_cpu_s"] / r["window_s"] for r in rows if r["phase"] != "flood")
    flood_row = rows[1]
    extra = flood_row["server_cpu_s"] - quiet_cpu_per_s * flood_row["window_s"]
    quiet_p95 = max(r["p95_ms"] for r in rows if r["phase"] != "flood")
    quiet_p50 = max(r["p50_ms"] for r in rows if r["phase"] != "flood")
    sent = sum(v for v in flood_counts.values()) / args.seconds
    per_refusal, ratio = 1000 * extra / max(refused, 1), flood_row["p95_ms"] / quiet_p95
    print(f"flood answers: {flood_counts} ({sent:.0f} req/s sent)")
    print(f"server CPU per refusal: {per_refusal:.3f} ms (goal <= 0.3); "
          f"polite p95 flood / quiet: {ratio:.2f}x (goal <= 2)")
    return {"http": http, "loop": loop, "flood_req_s": round(sent), "refused": refused,
            "cpu_ms_per_refusal": round(per_refusal, 3), "polite_p50_quiet_ms": quiet_p50,
            "polite_p50_flood_ms": flood_row["p50_ms"], "polite_p95_quiet_ms": quiet_p95,
            "polite_p95_flood_ms": flood_row["p95_ms"], "p95_ratio": round(ratio, 2)}


# ---------------------------------------------------------------------------------------------- retry (issue 37)
def burst(url: str, clients: int, max_tokens: int) -> dict:
    """`clients` requests at once; a refused client sleeps exactly Retry-After and tries again."""
    lock, start = threading.Lock(), threading.Barrier(clients)
    refusals: list[tuple[float, int, int]] = []  # (when, Retry-After, the refusal's rank for this client)
    retries: list[bool] = []
    waited: list[float] = []  # first refusal to admission, per refused client
    body = {"prompt": "1+1=", "max_tokens": max_tokens, "ignore_eos": True}

    def client(_: int) -> None:
        start.wait()
        first, retried = None, False
        with httpx.Client(timeout=300) as http:
            for k in range(60):
                r = http.post(url + "/generate", json=body)
                now = time.monotonic()
                with lock:
                    if retried:
                        retries.append(r.status_code == 200)
                    if r.status_code == 429:
                        refusals.append((now, int(r.headers["Retry-After"]), k))
                if r.status_code != 429:
                    if first is not None:
                        with lock:
                            waited.append(now - first)
                    return
                first = now if first is None else first
                retried = True
                time.sleep(int(r.headers["Retry-After"]))

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    values = [v for _, v, _ in sorted(refusals)]
    firsts = [v for _, v, k in sorted(refusals) if k == 0]
    return {"refusals": len(values), "retry_after_values": dict(sorted(Counter(values).items())),
            "first_refusals_in_order": firsts, "retries": len(retries),
            "admitted_at_retry_after": f"{sum(retries)}/{len(retries)} = {100 * sum(retries) / max(1, len(retries)):.0f}%",
            "refused_to_admitted_p50_s": round(statistics.median(waited), 1) if waited else None,
            "max_s": round(max(waited), 1) if waited else None}


def retry(args: argparse.Namespace, tmp: Path, model: str) -> None:
    from benchmarks.flood_split import start_layout

    for length in [int(x) for x in args.lengths.split(",")]:
        proc, url = start_layout(args.layout, model, tmp / f"retry-{length}.log", [
            "server.max_batch=4", f"server.max_queue={args.max_queue}", f"server.max_model_len={length + 32}",
            "server.log_level=warning"], args.baseline_root)
        rows = []
        try:
            rows.extend({"burst": i + 1, **burst(url, args.clients, length)} for i in range(args.bursts))
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"\n## saturating bursts ({args.layout}): {args.clients} clients at once, 4 slots, max_queue "
              f"{args.max_queue}, {length} tokens each; a refused client waits exactly Retry-After")
        for row in rows:
            print(json.dumps(row))


# ---------------------------------------------------------------------------------------------- store (issue 37)
def store(args: argparse.Namespace, tmp: Path, model: str) -> None:
    from tests.postgres import PostgresServer

    pg = PostgresServer.start()
    env = {"DLRL_ADMIN_TOKEN": ADMIN, "DLRL_FEEDBACK_TOKEN": FEEDBACK}
    try:
        proc, url = serve(model, tmp / "store.log", "server.max_batch=4", "server.max_model_len=64",
                          "server.record=all", f"server.store={pg.new_database('flood')}", "server.log_level=warning",
                          env=env)
        try:
            rows = store_phases(url, pg, args)
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        pg.destroy()
    print_rows(f"admin GET /weights/checksum while {args.posts} clients post feedback (PostgreSQL up, then stopped)",
               rows)


def store_phases(url: str, pg: object, args: argparse.Namespace) -> list[dict]:
    ids = [s["record_id"] for s in httpx.post(url + "/generate", json={"prompt": "1+1=", "max_tokens": 4, "n": 8},
                                              timeout=60).json()["samples"]]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    stop = threading.Event()
    answers: Counter = Counter()

    def poster(i: int) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {FEEDBACK}"}, timeout=60) as http:
            while not stop.is_set():
                try:
                    answers[http.post(url + "/v1/feedback", json={"id": ids[i % 8], "reward": 1.0}).status_code] += 1
                except httpx.HTTPError:
                    answers["error"] += 1

    rows = []
    threads = [threading.Thread(target=poster, args=(i,), daemon=True) for i in range(args.posts)]
    for t in threads:
        t.start()
    try:
        for phase in ("store up", "store down"):
            if phase == "store down":
                pg.stop("immediate")  # type: ignore[attr-defined]
            answers.clear()
            lat = []
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                r = httpx.get(url + "/weights/checksum", headers=admin, timeout=60)
                lat.append(time.perf_counter() - t0 if r.status_code == 200 else float("inf"))
                time.sleep(0.5)
            rows.append({"phase": phase, "checksum_n": len(lat), "p50_ms": ms(percentile(lat, 0.5)),
                         "max_ms": ms(max(lat)), "feedback_answers": dict(answers)})
    finally:
        stop.set()
        pg.restart()  # type: ignore[attr-defined]
        for t in threads:
            t.join(timeout=60)
    return rows


def floor(http: str, loop: str, args: argparse.Namespace, tmp: Path) -> dict:
    """CPU per request of uvicorn itself: a one-route ASGI app answering 429, under the same flood."""
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT), args.floor_path) if p)
    proc, _ = _start([sys.executable, "-c", FLOOR, str(port), http, loop], port, tmp / f"floor-{http}.log", None,
                     {"PYTHONPATH": path})
    try:
        flood = start_flood(port, raw_post("/generate", FLOODER, {"prompt": "1+1=", "max_tokens": 8}), args.rate,
                            args.conns, args.seconds / 2)
        c0 = cpu_s(proc)
        counts = flood[1].get(timeout=120)
        c1 = cpu_s(proc)
        flood[0].join()
    finally:
        proc.kill()
        proc.wait()
    return {"http": http, "loop": loop, "answers": sum(counts.values()),
            "cpu_ms_per_request": round(1000 * (sum(c1) - sum(c0)) / max(1, sum(counts.values())), 3)}


def floors(args: argparse.Namespace, tmp: Path) -> None:
    rows = [floor("h11", "asyncio", args, tmp)]
    if args.floor_path or all(importlib.util.find_spec(m) for m in ("httptools", "uvloop")):
        rows.append(floor("httptools", "uvloop", args, tmp))
    print_rows("the floor: uvicorn alone answering 429 to the same flood (no dlrl code)", rows)


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    keys_ = list(rows[0])
    print(" | ".join(keys_))
    for row in rows:
        print(" | ".join(str(row.get(k)) for k in keys_))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", nargs="?", default="headers",
                   choices=("headers", "keys", "retry", "store", "split", "stream", "all"))
    p.add_argument("--sockets", type=int, default=600, help="headers: slow sockets")
    p.add_argument("--seconds", type=float, default=None, help="length of each phase (headers 8, keys 20, retry 20, "
                                                                "store 12)")
    p.add_argument("--nofile", type=int, default=512, help="headers: the server's file limit")
    p.add_argument("--rate", type=float, default=400, help="keys: the flooding key's requests/s")
    p.add_argument("--conns", type=int, default=32, help="keys: the flooding key's connections")
    p.add_argument("--polite-rate", type=float, default=5, help="keys: the polite key's requests/s")
    p.add_argument("--log-level", default="info", help="keys: server.log_level of the server")
    p.add_argument("--clients", type=int, default=48, help="retry: clients in each burst")
    p.add_argument("--bursts", type=int, default=3, help="retry: bursts, one after the other")
    p.add_argument("--max-queue", type=int, default=8, help="retry: the server's max_queue")
    p.add_argument("--lengths", default="16", help="retry: tokens per request, comma-separated (one server each)")
    p.add_argument("--max-tokens", type=int, default=32, help="stream: tokens per request")
    p.add_argument("--layout", default="process", help="retry: the server's layout (process, thread, main)")
    p.add_argument("--layouts", default="main,thread,process", help="split, stream: layouts side by side "
                   "(process: the engine core in its own process; thread: one process; main: --baseline-root's code)")
    p.add_argument("--baseline-root", default="/work/main", help="split, stream: the source tree of layout main")
    p.add_argument("--stream-clients", type=int, default=256, help="stream: concurrent streaming clients")
    p.add_argument("--requests", type=int, default=2, help="stream: requests per client, one after the other")
    p.add_argument("--posts", type=int, default=48, help="store: feedback clients")
    p.add_argument("--protocols", default="h11,httptools", help="keys: the servers measured one after the other, "
                   "comma-separated: h11 (server.http=h11 server.loop=asyncio), httptools (httptools + uvloop)")
    p.add_argument("--floor-path", default="", help="keys: a folder holding httptools and uvloop, for the floor "
                   "(when they are not installed)")
    args = p.parse_args()
    unknown = [name for name in args.protocols.split(",") if name not in PROTOCOLS]
    if unknown:
        p.error(f"--protocols: unknown {', '.join(unknown)} (known: {', '.join(PROTOCOLS)})")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = tiny_model(tmp / "model")
        scenarios = ("keys", "retry", "store") if args.scenario == "all" else (args.scenario,)
        given = args.seconds
        for name in scenarios:
            args.seconds = given or {"headers": 8.0, "keys": 20.0, "retry": 0.0, "store": 12.0, "split": 20.0,
                                     "stream": 0.0}[name]
            if name in ("split", "stream"):
                from benchmarks import flood_split

                args.clients = args.stream_clients if name == "stream" else args.clients
                getattr(flood_split, name)(args, tmp, model)
            else:
                globals()[name](args, tmp, model)


if __name__ == "__main__":
    main()
