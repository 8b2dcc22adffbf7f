"""CPU per refusal of dlrl's own ASGI path, without any HTTP server: the app `dlrl serve` builds (tiny random
model, one API key at 1 request/s) called directly with an over-quota POST /generate, N times.

    PYTHONPATH=. .venv/bin/python benchmarks/refusal_path.py [--n 5000] [--profile]

Side by side with `benchmarks/flood.py keys` (the whole server under a real flood, the same refusal): what this
prints is the part of a refusal's cost that is dlrl's ASGI code (gate, quotas, counters, the JSON body,
starlette / FastAPI's outer layers); the rest of flood.py's number is the HTTP server and the process.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

from dllm.embedded.tiny import SMALL_ARCH, random_tiny_folder
from server.api.app import create_app
from server.config import ServerConfig
from server.engine.backends.native import NativeBackend
from server.engine.engine import Engine

KEY = "flood-key-0123456789"


def build_app(workdir: Path) -> Any:
    model = str(random_tiny_folder(workdir / "model", **SMALL_ARCH))
    keys = workdir / "keys.yaml"
    keys.write_text(f"keys:\n  flood: {{key: '{KEY}', requests_per_s: 1}}\n")
    config = ServerConfig(model=model, port=1, device="cpu", dtype="float32", api_keys_file=str(keys),
                          resource_log_interval_s=3600)
    backend = NativeBackend.from_pretrained(model, device="cpu", dtype="float32", max_batch=2, max_model_len=64)
    return create_app(Engine(backend, max_queue=config.max_queue, max_queue_tokens=config.max_queue_tokens,
                             model_name=config.model_name()), config)


def refuse(app: Any, n: int) -> list[int]:
    """Call the app n times with an over-quota request; the statuses it answered."""
    body = json.dumps({"prompt": "1+1=", "max_tokens": 8}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/generate", "raw_path": b"/generate", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {KEY}".encode()),
                         (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 1), "state": {}}
    statuses: list[int] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def run() -> None:
        for _ in range(n):
            await app(dict(scope), receive, send)

    asyncio.run(run())
    return statuses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="refusals to time")
    ap.add_argument("--profile", action="store_true", help="print the 20 costliest calls (cProfile)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        app = build_app(Path(tmp))
        refuse(app, 200)  # warm: the middleware stack is built on the first call, the bucket runs dry
        t = time.process_time()
        statuses = refuse(app, args.n)
        per = 1000 * (time.process_time() - t) / args.n
        assert set(statuses) == {429}, set(statuses)
        print(f"dlrl's ASGI path: {per:.3f} ms CPU per refusal ({args.n} over-quota POST /generate, all 429)")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            refuse(app, args.n)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
