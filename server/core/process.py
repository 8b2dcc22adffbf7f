"""The two kinds of child process of `dlrl serve` (server.core.supervisor starts them; not a user command).

    python -m server.core.process core --address ipc://... --model DIR --ready-fd 5          < config.json
    python -m server.core.process api --index 0 --address ipc://... --core-pid 123 --listen-fd 4 --ready-fd 6 < config.json

The config (the resolved `server` section as JSON, tokens included) comes on stdin, never on the
command line. Each child dies with the supervisor (a parent-death signal: SIGTERM), runs in its own
process group (a terminal's Ctrl-C reaches only the supervisor, which stops them in order) and
writes one JSON line on its `--ready-fd` once ready, or the error that stopped it.

- `core`: builds the engine as `dlrl serve` always did (server.cli.build_engine), then serves the
  channel (server.core.engine_core.EngineCore). SIGTERM: the engine shuts down (what still runs is
  aborted and its API processes hear it), the receiver closes, exit 0. SIGINT is ignored: the
  supervisor decides when the core stops (after the API processes drained).
- `api`: the HTTP server (server.api.app.create_api_app, server.api.lifecycle.http_server) on the
  listening socket the supervisor bound (`--listen-fd`, shared by every API process: the kernel
  hands each connection to one). SIGTERM / SIGINT: drain, as ever. If the engine core dies, its
  requests get 503 naming why, and the process exits 1 after `CORE_GONE_EXIT_S`.
Exit status 2: a configuration error (the message names the key), as `dlrl serve` itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys

from dlrl_config import ConfigError
from server.config import ServerConfig
from server.core.lifelines import die_with_parent

log = logging.getLogger("dlrl.server")
CORE_GONE_EXIT_S = 1.0  # after the engine core died: time for the 503s in flight to go out


def _ready(fd: int, **fields: object) -> None:
    """One JSON line on the supervisor's pipe (ready, or the error that stops this process)."""
    try:
        os.write(fd, (json.dumps(fields) + "\n").encode())
        os.close(fd)
    except OSError:  # the supervisor is gone: the parent-death signal follows
        pass


def _logging(config: ServerConfig, role: str) -> None:
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [{role}]: %(message)s")
    if config.log_format == "json":
        from server.logs import use_json_logs

        use_json_logs()


def run_core(args: argparse.Namespace, config: ServerConfig) -> int:
    from server.cli import build_engine
    from server.core.engine_core import EngineCore
    from server.engine.backends import BackendUnavailable

    _logging(config, "core")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = build_engine(config, args.model)
    except (BackendUnavailable, ConfigError) as e:
        _ready(args.ready_fd, error=str(e))
        return 2
    except (ValueError, FileNotFoundError) as e:  # bad folder / option: the message names it
        _ready(args.ready_fd, error=f"cannot load {args.model}: {e}")
        return 2
    log.info("serving model %s (%s) from %s with backend %s, max_batch=%d, max_model_len=%d (engine core, pid %d)",
             engine.model_name, getattr(engine.model, "dtype", "?"), args.model, config.backend, config.max_batch,
             engine.max_model_len, os.getpid())
    core = EngineCore(engine, config, args.model)

    async def main() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, core.stop)
        await core.serve(args.address, lambda: _ready(args.ready_fd, pid=os.getpid()))

    if config.resolved_loop() == "uvloop":  # server.loop: the core's message loop too
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(main())
    return 0


def run_api(args: argparse.Namespace, config: ServerConfig) -> int:
    from server.api.app import create_api_app
    from server.api.lifecycle import http_server

    _logging(config, f"api-{args.index}")
    if config.api_nice:
        os.nice(config.api_nice)
    status = {"code": 0}
    server = None

    def core_gone(reason: str) -> None:  # on the loop: answer 503s a moment, then exit non-zero
        status["code"] = 1
        log.error("%s: this API process stops (exit 1)", reason)

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        asyncio.get_running_loop().call_later(CORE_GONE_EXIT_S, stop)

    try:
        app = create_api_app(config, args.address, index=args.index, core_pid=args.core_pid, on_core_exit=core_gone)
        server = http_server(app, config, on_started=lambda: _ready(args.ready_fd, pid=os.getpid()))
    except ConfigError as e:  # e.g. server.store cannot be opened, the file limit leaves no connections
        _ready(args.ready_fd, error=str(e))
        return 2
    sock = socket.socket(fileno=args.listen_fd)
    server.run(sockets=[sock])
    if not server.started and status["code"] == 0:  # the app failed to start (its error is logged)
        _ready(args.ready_fd, error="the API process did not start (see the log above)")
        return 1
    return status["code"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.core.process", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=("core", "api"))
    p.add_argument("--address", required=True)
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    p.add_argument("--model", default="")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--core-pid", type=int, default=None)
    p.add_argument("--listen-fd", type=int, default=-1)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    config = ServerConfig.model_validate_json(sys.stdin.read())
    return run_core(args, config) if args.role == "core" else run_api(args, config)


if __name__ == "__main__":
    raise SystemExit(main())
