"""Benchmark rollback to a kept version (POST /weights/rollback) against a push of the same model.

    .venv/bin/python benchmarks/rollback.py                         # 100m (about a minute)
    .venv/bin/python benchmarks/rollback.py --sizes 100m,500m --dtype bfloat16

For each size (SDAR-shaped random tensors, benchmarks/sync.py `sdar_like`) it starts a
receiver in ANOTHER process -- the real server.api.routes_weights + WeightUpdates glue with
`keep_versions=2` over uvicorn and an idle engine (never started: its pause is instant, the same for both
paths) -- and from this process, per transport: connects once, pushes versions 1..N
(each with different weights), waits after each push until the server has copied it to host
memory (the "keep" column: background work after every commit, off the request path), and
takes the median of the steady pushes. Then it rolls back between the last two versions R
times (client-side time of the whole HTTP call, and the server's own pause + verify +
copy time) and checks /weights/checksum against the digest of the weights of the version
rolled back to. "push/rollback" is how many times faster the rollback is.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from sync import add_receiver_args, bench_parser, idle_engine, module_from, parse_or_serve, sdar_like  # noqa: E402
from sync import start_receiver as start_sync_receiver  # noqa: E402

TOKEN = "bench"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def serve(size: str, port: int, dtype: str) -> None:
    """The receiver process: real weight routes with kept versions, an idle engine."""
    import logging
    from contextlib import asynccontextmanager

    import uvicorn
    from fastapi import FastAPI

    from server.api import routes_weights
    from server.api.state import ServerState, attach
    from server.config import ServerConfig
    from server.weights.weight_updates import make_updates

    logging.basicConfig(level=logging.WARNING)

    engine = idle_engine(module_from({n: t.to(getattr(torch, dtype)) for n, t in sdar_like(size, seed=1).items()}))
    updates = make_updates(engine, ServerConfig(keep_versions=2))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        updates.start_capture()
        yield

    app = FastAPI(lifespan=lifespan)
    attach(app, ServerState(engine, admin_token=TOKEN, weight_updates=updates))
    app.include_router(routes_weights.router)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def start_receiver(size: str, dtype: str, threads: int) -> tuple[subprocess.Popen, str]:
    """This file's receiver in another process, once it has kept version 0."""
    import httpx

    def ready(url: str) -> bool:
        return httpx.get(url + "/weights/kept", headers=AUTH, timeout=2).json()["versions"] == [0]

    return start_sync_receiver(size, threads, dtype, script=__file__, ready=ready)


def wait_kept(url: str, version: int) -> float:
    """Seconds until `version` is in the server's kept list."""
    import httpx

    t0 = time.perf_counter()
    while version not in httpx.get(url + "/weights/kept", headers=AUTH, timeout=60).json()["versions"]:
        time.sleep(0.005)
    return time.perf_counter() - t0


def bench(size: str, transport: str, pushes: int, rollbacks: int, dtype: str, threads: int) -> dict:
    import httpx

    from weight_sync import WeightSender, weights_digest

    named = sdar_like(size, seed=2)
    served = getattr(torch, dtype)
    proc, url = start_receiver(size, dtype, threads)
    try:
        sender = WeightSender([url], transport=transport, token=TOKEN, timeout=600, dtype="auto")
        sender.connect(named)
        push_s, keep_s, digests = [], [], {}
        for version in range(1, pushes + 1):
            named["model.norm.weight"].fill_(float(version))  # each version has its own weights
            push_s.append(sender.push(named, version)["total_s"])
            keep_s.append(wait_kept(url, version))
            digests[version] = weights_digest({n: t.to(served) for n, t in named.items()})
        sender.close()
        client_s, server_s, ok = [], [], True
        with httpx.Client(base_url=url, headers=AUTH, timeout=600) as client:  # kept alive, as the sender's
            for i in range(rollbacks):
                target = pushes - 1 if i % 2 == 0 else pushes
                t0 = time.perf_counter()
                r = client.post("/weights/rollback", json={"version": target})
                client_s.append(time.perf_counter() - t0)
                r.raise_for_status()
                server_s.append(r.json()["seconds"])
                check = client.get("/weights/checksum").json()
                ok = ok and check == {"version": target, "digest": digests[target]}
    finally:
        proc.terminate()
        proc.wait(30)
    nbytes = sum(t.numel() for t in named.values()) * served.itemsize
    return {"size": size, "mb": nbytes / 1e6, "transport": transport,
            "push_s": statistics.median(push_s[1:]) if len(push_s) > 1 else push_s[0],
            "keep_s": statistics.median(keep_s), "rollback_s": statistics.median(client_s),
            "rollback_server_s": statistics.median(server_s), "ok": ok}


HEADER = (f"{'size':>5} {'MB':>6} {'transport':>9} {'push s':>7} {'keep s':>7} {'rollback s':>10} "
          f"{'(server)':>8} {'push/rollback':>13} {'checksum':>8}")


def print_row(r: dict) -> None:
    print(f"{r['size']:>5} {r['mb']:>6.0f} {r['transport']:>9} {r['push_s']:>7.3f} {r['keep_s']:>7.3f} "
          f"{r['rollback_s']:>10.3f} {r['rollback_server_s']:>8.3f} {r['push_s'] / r['rollback_s']:>12.1f}x "
          f"{'ok' if r['ok'] else 'BAD':>8}", flush=True)


def main() -> None:
    ap = bench_parser(__doc__, "100m", "shm,http", 4)
    ap.add_argument("--rollbacks", type=int, default=6)
    add_receiver_args(ap, "dtype the receiver serves")
    parsed = parse_or_serve(ap, serve)
    if parsed is None:
        return
    args, sizes = parsed
    if args.pushes < 2:
        ap.error("--pushes: at least 2 (a rollback needs an earlier version)")
    print(HEADER)
    for size in sizes:
        for transport in args.transports.split(","):
            print_row(bench(size, transport.strip(), args.pushes, args.rollbacks, args.dtype, args.threads))


if __name__ == "__main__":
    main()
