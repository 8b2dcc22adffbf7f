"""The cost of recording (issue 26): sustained load against real `dlrl serve` processes, side by side
in one run -- recording off, recording `all` into SQLite on one replica, recording `all` into one
PostgreSQL store from two replicas -- each recording setup without and with feedback on every
response.

    .venv/bin/python benchmarks/fleet.py                        # 20 s per setup, 16 clients, 2 rounds
    .venv/bin/python benchmarks/fleet.py --seconds 60 --clients 32 --pg-url postgresql://...

Each setup: start its servers (random tiny SDAR, max_batch 32), run `--clients` closed-loop
clients for `--seconds` (each: POST /v1/completions with `--max-tokens` (8), and when recording a
POST /v1/feedback on the returned record_id sent beside its next request in the `+ feedback`
setups), stop them. Reports requests/s,
p50/p99 generation latency, p50/p99 feedback latency, the servers' mean record write
(dlrl_record_write_seconds: one batched commit), errors, and throughput relative to
recording off on the same number of replicas (the goal: recording costs <= 5 %).

It also reports the CPU each request cost: the servers' processes, the throwaway database's
processes (its backends, WAL writer and the workers the postmaster reaped; not counted with
--pg-url) and this client, read from /proc before and after the timed load. On a machine whose
cores are all busy, throughput is the cores divided by this, and it varies far less from round
to round than req/s does (a burst of load elsewhere slows every process but does not add to
their CPU time), so `CPU vs off` (off's CPU per request / the setup's) says what recording
costs where req/s rounds disagree by more than the goal's margin.
Without --pg-url a throwaway PostgreSQL server is started (tests/postgres.py: initdb +
pg_ctl, installed with apt-get when missing and root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FEEDBACK = "bench-feedback-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(tmp: Path) -> str:
    from dllm.embedded.tiny import random_tiny_folder

    return random_tiny_folder(tmp / "tiny")


def start_servers(model: str, n: int, store: str | None, tmp: Path) -> list[tuple[str, subprocess.Popen]]:
    out = []
    env = dict(os.environ, DLRL_ADMIN_TOKEN="bench-admin", DLRL_FEEDBACK_TOKEN=FEEDBACK, OMP_NUM_THREADS="1")
    for _ in range(n):
        port = free_port()
        rec = ["server.record=all", f"server.store={store}"] if store else []
        cmd = [sys.executable, "-m", "dlrl.cli", "serve", "--model", model, "--port", str(port), "server.device=cpu",
               "server.dtype=float32", "server.max_batch=32", "server.max_queue=1024", "server.log_level=warning",
               *rec]
        log = open(tmp / f"server-{port}.log", "ab")
        out.append((f"http://127.0.0.1:{port}", subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
    from rollout_client.ready import ServerExited, wait_ready

    procs = dict(out)
    try:
        wait_ready(list(procs), timeout=300, exited=lambda url: procs[url].poll() is not None)
    except (ServerExited, TimeoutError) as e:
        raise RuntimeError(f"{e} (logs in {tmp})") from None
    return out


def stop_servers(servers: list[tuple[str, subprocess.Popen]]) -> None:
    for _, proc in servers:
        proc.send_signal(signal.SIGTERM)
    for _, proc in servers:
        proc.wait(timeout=60)


async def load(urls: list[str], clients: int, seconds: float, feedback: bool, max_tokens: int = 8) -> dict:
    gen_lat, fb_lat, errors = [], [], []
    deadline = time.monotonic() + seconds

    async def give_feedback(http: httpx.AsyncClient, url: str, rid: str, reward: float) -> None:
        t0 = time.perf_counter()
        f = await http.post(url + "/v1/feedback", json={"id": rid, "reward": reward},
                            headers={"Authorization": f"Bearer {FEEDBACK}"})
        fb_lat.append(time.perf_counter() - t0)
        if f.status_code != 200:
            errors.append(f"feedback {f.status_code}")

    async def client(i: int) -> None:
        url = urls[i % len(urls)]  # round robin over the replicas, as a load balancer would
        pending = []  # feedback goes out beside the next request (a user rates while asking again)
        async with httpx.AsyncClient(timeout=60) as http:
            k = 0
            while time.monotonic() < deadline:
                k += 1
                t0 = time.perf_counter()
                r = await http.post(url + "/v1/completions", json={"prompt": f"{i}+{k}=", "max_tokens": max_tokens,
                                                                   "strategy": "static"})
                gen_lat.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(r.status_code)
                    continue
                rid = r.json()["choices"][0].get("record_id")
                if feedback:
                    if rid is None:
                        errors.append("no record_id")
                        continue
                    pending.append(asyncio.ensure_future(give_feedback(http, url, rid, float(k % 2))))
            await asyncio.gather(*pending)

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.monotonic() - t0
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1000 if len(xs) > 1 else float("nan")  # noqa: E731
    return {"requests": len(gen_lat), "req_per_s": len(gen_lat) / wall, "p50_ms": q(gen_lat, 50),
            "p99_ms": q(gen_lat, 99), "feedback_p50_ms": q(fb_lat, 50), "feedback_p99_ms": q(fb_lat, 99),
            "errors": len(errors)}


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and of the children they reaped (a PostgreSQL
    postmaster's autovacuum workers), plus this client process's own."""
    total = sum(os.times()[:2])
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def database_pids(pg) -> list[int]:
    """The throwaway PostgreSQL server's processes (the postmaster and its children)."""
    if pg is None:
        return []
    master = psutil.Process(int((pg.data / "postmaster.pid").read_text().split()[0]))
    return [master.pid, *(c.pid for c in master.children(recursive=True))]


def record_write_ms(urls: list[str]) -> float:
    total = count = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("dlrl_record_write_seconds_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("dlrl_record_write_seconds_count"):
                count += float(line.rsplit(" ", 1)[1])
    return total / count * 1000 if count else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8, help="per request (8: the worst case for recording's share)")
    ap.add_argument("--rounds", type=int, default=2, help="setups take turns this many times; best round reported")
    ap.add_argument("--pg-url", default="", help="an existing PostgreSQL database (default: start a throwaway one)")
    ap.add_argument("--no-feedback", action="store_true", help="skip the two `+ feedback` setups")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dlrl-fleet-bench-"))
    model = make_model(tmp)
    pg = None
    if not args.pg_url:
        from tests.postgres import PostgresServer

        pg = PostgresServer.start()
    pg_url = args.pg_url or pg.new_database("bench")
    sqlite = str(tmp / "fb.db")
    setups = [("1 replica, recording off", 1, None, False), ("1 replica, SQLite, record all", 1, sqlite, False),
              ("1 replica, SQLite, record all + feedback", 1, sqlite, True),
              ("2 replicas, recording off", 2, None, False), ("2 replicas, PostgreSQL, record all", 2, pg_url, False),
              ("2 replicas, PostgreSQL, record all + feedback", 2, pg_url, True)]
    if args.no_feedback:
        setups = [s for s in setups if not s[3]]
    best: dict[str, dict] = {}
    total: dict[str, float] = {}  # req/s summed over the rounds (the mean ratio: setups share each round's noise)
    cpu: dict[str, list[float]] = {}  # CPU ms per request of each round
    try:
        for _ in range(args.rounds):  # the setups take turns, so a burst of load elsewhere hits all of them
            for name, n, store, feedback in setups:
                servers = start_servers(model, n, store, tmp)
                urls = [u for u, _ in servers]
                try:
                    asyncio.run(load(urls, args.clients, 2.0, feedback, args.max_tokens))  # warm-up
                    pids = [p.pid for _, p in servers] + (database_pids(pg) if store == pg_url else [])
                    cpu0 = cpu_seconds(pids)
                    res = asyncio.run(load(urls, args.clients, args.seconds, feedback, args.max_tokens))
                    res["cpu_ms_per_request"] = (cpu_seconds(pids) - cpu0) / max(res["requests"], 1) * 1000
                    res["record_write_ms"] = record_write_ms(urls) if store else float("nan")
                finally:
                    stop_servers(servers)
                row = {"setup": name, "replicas": n, **res}
                print(json.dumps(row), flush=True)
                total[name] = total.get(name, 0.0) + row["req_per_s"]
                cpu.setdefault(name, []).append(row["cpu_ms_per_request"])
                if name not in best or row["req_per_s"] > best[name]["req_per_s"]:
                    best[name] = row
    finally:
        if pg is not None:
            pg.destroy()
    rows = [best[name] for name, *_ in setups]
    off = {r["replicas"]: r["req_per_s"] for r in rows if "off" in r["setup"]}
    off_total = {r["replicas"]: total[r["setup"]] for r in rows if "off" in r["setup"]}
    print(f"\n{args.clients} clients, {args.seconds:.0f} s per setup, best of {args.rounds} rounds, "
          f"max_tokens {args.max_tokens}\n")
    cpu_median = {name: statistics.median(v) for name, v in cpu.items()}
    off_cpu = {r["replicas"]: cpu_median[r["setup"]] for r in rows if "off" in r["setup"]}
    print("| setup | req/s | vs off | mean vs off | CPU ms/req (median) | CPU vs off | p50 ms | p99 ms "
          "| feedback p50/p99 ms | record write ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = cpu_median[r["setup"]]
        print(f"| {r['setup']} | {r['req_per_s']:.1f} | {r['req_per_s'] / off[r['replicas']]:.3f} "
              f"| {total[r['setup']] / off_total[r['replicas']]:.3f} | {c:.3f} | {off_cpu[r['replicas']] / c:.3f} "
              f"| {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['feedback_p50_ms']:.1f} / {r['feedback_p99_ms']:.1f} "
              f"| {r['record_write_ms']:.2f} | {r['errors']} |")
    if args.pg_url:
        print("\n(--pg-url: the database's CPU is not in the CPU columns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
