"""Soak test: live mixed traffic against a real `dlrl serve` while weights are pushed into it.

    .venv/bin/python benchmarks/soak.py                       # 64 clients, 10 minutes, a push every 20 s
    .venv/bin/python benchmarks/soak.py --duration 120 --clients 32 --transport http

Starts a throwaway PostgreSQL server (tests/postgres.py: initdb + pg_ctl) and `dlrl serve
--config configs/tiny.yaml` (the trained embedded default if runs/tiny-sft exists, else random
weights of its architecture) recording `all` into it, with API keys and a small KV cache
(`--kv-cache`). For `--duration` seconds (bounded): `--clients` closed-loop clients on
`--keys` API keys send a random mix of /v1/completions, /v1/chat/completions (streaming and
not) and /generate, 10% hanging up (half mid-stream after 1-3 chunks, half after 10-500 ms);
`--long-clients` send cache-exhausting long requests (300-480 tokens, n 1-3, half with a
`timeout`); one more key floods at `--flood-rps` over its quota during every other
`--flood-window`; feedback workers post feedback on a share of the acknowledged records
(retrying 503s). A pusher calls `weight_sync.push` every `--push-every` seconds (http and
shm alternating), and PostgreSQL is stopped for `--pg-down` seconds at mid-run.

Reports (goals): 5xx (0), transport/stream errors (0), requests by client and outcome, the
normal keys' p50/p99 latency with the flood on vs off in the same run (p99 within 20%),
latency with/without a push, lost acknowledged records and feedback (every record_id a
client got, every feedback answered 200, must be in the store at the end: 0), server RSS
after warm-up and at the end (bounded), KV slots and pages free at the end (all), and
the server's exit status after SIGTERM (0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.soak_report import check_store, report, server_counters  # noqa: E402
from benchmarks.soak_traffic import Stats, client, feedback_worker, flood_process  # noqa: E402
from dllm.weights import load_pretrained  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402
from weight_sync import WeightSender  # noqa: E402

TOKEN = "soak-token"
FEEDBACK_TOKEN = "soak-feedback-token"


def _model(tmp: Path) -> str:
    """The trained embedded default if present, else random weights with its architecture."""
    from dllm.embedded.tiny import load_tiny_sections, random_tiny_folder

    arch, _, sft = load_tiny_sections(str(ROOT / "configs/tiny.yaml"))
    trained = ROOT / sft.output_dir
    if (trained / "config.json").is_file():
        return str(trained)
    return random_tiny_folder(tmp / "tiny-random", arch)


def _pusher(base: str, model_dir: str, transports: list[str], every: float, t_start: float, stop_at: float,
            stats: Stats) -> None:
    """Push k starts at t_start + k x every (or when push k-1 ends, if later): a fixed schedule,
    so that the flood's on and off windows (a multiple of `every`) hold as many pushes each."""
    named = list(load_pretrained(model_dir).hf_named_tensors())
    senders = {t: WeightSender([base], transport=t, token=TOKEN, timeout=120) for t in transports}  # kept open
    version = 0
    try:
        while t_start + (version + 1) * every < stop_at:
            version += 1
            time.sleep(max(0.0, t_start + version * every - time.monotonic()))
            transport = transports[version % len(transports)]
            t0 = time.monotonic()
            try:
                senders[transport].push(named, version=version)
            except Exception as e:  # reported, never fatal
                stats.push_errors.append(f"v{version} {transport}: {e}")
            stats.pushes.append((t0, time.monotonic(), version, transport))
    finally:
        for sender in senders.values():  # shm region, dist group, http clients
            sender.close()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sample_rss(pid: int, stats: Stats, stop: threading.Event) -> None:
    while not stop.wait(5.0):
        stats.rss.append((time.monotonic(), _rss(pid)))


def _pg_restart(pg, at: float, down_s: float, stats: Stats) -> None:
    """Stop the PostgreSQL server at `at` (monotonic), start it again `down_s` later."""
    time.sleep(max(0.0, at - time.monotonic()))
    t0 = time.monotonic()
    print(f"soak: stopping PostgreSQL for {down_s:.0f}s", flush=True)
    pg.stop("fast")
    time.sleep(down_s)
    pg.restart()
    stats.pg_down.append((t0, time.monotonic()))
    print("soak: PostgreSQL is back", flush=True)


def _keys_file(tmp: Path, args: argparse.Namespace) -> tuple[Path, list[str], str, str]:
    normal = [f"sk-soak-normal-{i:02d}-{'x' * 8}" for i in range(args.keys)]
    long_key, flood_key = "sk-soak-long-xxxxxxxx", "sk-soak-flood-xxxxxxx"
    keys = {f"normal{i}": {"key": k} for i, k in enumerate(normal)}
    keys["long"] = {"key": long_key}
    keys["flood"] = {"key": flood_key, "requests_per_s": args.flood_quota, "max_concurrent": 2}
    path = tmp / "keys.yaml"
    path.write_text(json.dumps({"keys": keys}))  # JSON is YAML
    return path, normal, long_key, flood_key


def _start_server(model_dir: str, port: int, tmp: Path, args: argparse.Namespace, store_url: str,
                  keys_file: Path) -> subprocess.Popen:
    log_path = tmp / "server.log"
    cmd = [sys.executable, "-m", "server.cli", "--config", str(ROOT / "configs/tiny.yaml"), "--model", model_dir,
           "--port", str(port), f"server.max_batch={args.max_batch}", "server.admin_token_file=",
           "server.log_level=warning", "server.shutdown_timeout=30", "server.record=all",
           f"server.store={store_url}", "server.store_max_records=10000000",
           f"server.kv_cache_memory={args.kv_cache}", f"server.api_keys_file={keys_file}"]
    env = {**os.environ, "DLRL_ADMIN_TOKEN": TOKEN, "DLRL_FEEDBACK_TOKEN": FEEDBACK_TOKEN}
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


async def _traffic(base: str, args: argparse.Namespace, stop_at: float, stats: Stats,
                   keys: tuple[list[str], str]) -> None:
    normal, long_key = keys
    stats.feedback_queue = asyncio.Queue()
    workers = [asyncio.create_task(feedback_worker(base, FEEDBACK_TOKEN, stats.feedback_queue, stats,
                                                   args.feedback_share)) for _ in range(4)]
    clients = [client(i, base, normal[i % len(normal)], stop_at, stats, args.disconnect) for i in range(args.clients)]
    clients += [client(i, base, long_key, stop_at, stats, 0.0, cls="long", max_tokens=(300, 480), n=(1, 3),
                       deadline_s=args.long_timeout) for i in range(args.long_clients)]
    await asyncio.gather(*clients)
    for _ in workers:
        stats.feedback_queue.put_nowait(None)  # after the queued ids: workers finish them, then stop
    await asyncio.wait_for(asyncio.gather(*workers), timeout=300)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (bounded)")
    p.add_argument("--clients", type=int, default=64, help="closed-loop clients of short mixed requests")
    p.add_argument("--keys", type=int, default=4, help="API keys the normal clients share")
    p.add_argument("--push-every", type=float, default=20.0)
    p.add_argument("--transport", choices=["http", "shm", "both"], default="both")
    p.add_argument("--disconnect", type=float, default=0.1, help="fraction of requests the client abandons")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kv-cache", default="4MiB", help="server.kv_cache_memory (4MiB: 1024 pages of the tiny "
                   "model, 8 max-length sequences, so the long requests exhaust it)")
    p.add_argument("--long-clients", type=int, default=6, help="clients of long requests (300-480 tokens, n 1-3)")
    p.add_argument("--long-timeout", type=float, default=8.0, help="half the long requests carry this `timeout`")
    p.add_argument("--flood-rps", type=float, default=100.0, help="the flooding key's request rate")
    p.add_argument("--flood-quota", type=float, default=2.0, help="the flooding key's requests_per_s quota")
    p.add_argument("--flood-window", type=float, default=40.0,
                   help="flood on every other window of this length (a multiple of --push-every: as many pushes "
                        "fall in the flood's on and off windows)")
    p.add_argument("--feedback-share", type=float, default=0.5, help="share of acknowledged records given feedback")
    p.add_argument("--pg-down", type=float, default=30.0, help="seconds PostgreSQL is stopped, mid-run")
    p.add_argument("--warmup", type=float, default=30.0, help="RSS growth and latencies are measured from here on")
    p.add_argument("--json", default="", help="also write the report here")
    return p.parse_args()


def _drain(base: str, max_batch: int) -> dict:
    """/health once nothing runs or waits (disconnected sequences are released), at most 60 s."""
    deadline = time.monotonic() + 60
    health = httpx.get(base + "/health", timeout=10).json()
    while (health["num_running"] or health["num_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        health = httpx.get(base + "/health", timeout=10).json()
    health["max_batch"] = max_batch
    return health


def main() -> None:
    args = _args()
    pg = PostgresServer.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = _run(args, Path(tmp), pg)
    finally:
        pg.destroy()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def _run(args: argparse.Namespace, tmp: Path, pg) -> dict:
    model_dir = _model(tmp)
    store_url = pg.new_database("soak")
    keys_file, normal, long_key, flood_key = _keys_file(tmp, args)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start_server(model_dir, port, tmp, args, store_url, keys_file)
    stats = Stats()
    stop = threading.Event()
    threading.Thread(target=_sample_rss, args=(proc.pid, stats, stop), daemon=True).start()
    t_start = time.monotonic()
    stop_at = t_start + args.duration
    transports = ["http", "shm"] if args.transport == "both" else [args.transport]
    pusher = threading.Thread(target=_pusher, args=(base, model_dir, transports, args.push_every, t_start, stop_at, stats),
                              daemon=True)
    pusher.start()
    restarter = threading.Thread(target=_pg_restart, args=(pg, t_start + args.duration / 2, args.pg_down, stats),
                                 daemon=True)
    restarter.start()
    print(f"soak: {args.clients} clients + {args.long_clients} long + a flood for {args.duration:.0f}s against "
          f"{base} ({model_dir}), push every {args.push_every:.0f}s over {'/'.join(transports)}, "
          f"recording all into PostgreSQL", flush=True)
    recv, send = multiprocessing.Pipe(duplex=False)
    flooder = multiprocessing.get_context("spawn").Process(
        target=flood_process, args=(base, flood_key, t_start, stop_at, args.flood_rps, args.flood_window, send))
    flooder.start()
    try:
        asyncio.run(_traffic(base, args, stop_at, stats, (normal, long_key)))
        if recv.poll(120):
            records, stats.flood_windows, acked, nulls = recv.recv()
            stats.records += records
            stats.acked |= acked
            stats.null_ids += nulls
        flooder.join(timeout=30)
        pusher.join(timeout=180)
        restarter.join(timeout=180)
        health = _drain(base, args.max_batch)
        end_rss = _rss(proc.pid)
        counters = server_counters(httpx.get(base + "/metrics", timeout=10).text)
        log = (tmp / "server.log").read_text(errors="replace")
        counters["server_log_tracebacks"] = log.count("Traceback")
        if "Traceback" in log:
            counters["server_log_first_traceback"] = log[log.index("Traceback"):][:600]
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = None
    return report(stats, t_start, t_start + args.warmup, end_rss, health, exit_code,
                  check_store(store_url, stats), counters)


if __name__ == "__main__":
    main()
