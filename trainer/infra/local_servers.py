"""Local server PROCESSES: the `dlrl serve` processes the trainer (and `dlrl eval`) start themselves
on this machine when none answers at a local address (trainer.infra.fleet.ServerFleet is the client
that talks to them, or to servers running anywhere else).

    srv = LocalServer("http://127.0.0.1:8000", "configs/tiny.yaml", model="", overrides=[...],
                      token=tok, log_path=Path("runs/x/server0.log"))
    ...
    srv.stop()      # SIGTERM to its process group, SIGKILL after a grace period

The server runs `dlrl serve` in its own process group with a parent-death signal: if the
trainer dies, even by SIGKILL, its servers get SIGTERM and exit. The trainer never imports
the server package: they only meet over HTTP and weight_sync.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("dlrl.train")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the process group still lets stop() reach it
        pass


SERVED_SECTIONS = ("server.", "model.", "task.", "sft.")  # what `dlrl serve` reads of the run's config
ADDRESS_KEYS = ("server.host", "server.port")  # a started server's address is its URL's: never forwarded


def is_local(url: str) -> bool:
    return urlparse(url).hostname in ("127.0.0.1", "localhost", "::1")


def serve_command(url: str, config_path: str | None, model: str, overrides: list[str]) -> list[str]:
    """The `dlrl serve` command line of the local server for `url`: --host/--port from the URL, the
    run's config file, `server.model`, and the overrides of the sections the server reads -- `server.*` but
    server.host/server.port (the server refuses a key given both as --port and server.port=...;
    address_problems reports them), and the embedded default's `model.*`, `task.*`, `sft.*` (without
    train.model the server serves the default the trainer trained: the same folder, trained alike)."""
    u = urlparse(url)
    cmd = [sys.executable, "-m", "dlrl.cli", "serve", "--host", u.hostname or "127.0.0.1", "--port", str(u.port or 80)]
    if config_path:
        cmd += ["--config", str(config_path)]
    if model:
        cmd += [f"server.model={model}"]
    return cmd + [o for o in overrides if o.startswith(SERVED_SECTIONS) and o.split("=", 1)[0] not in ADDRESS_KEYS]


def address_problems(urls: list[str], overrides: list[str], prefix: str) -> list[str]:
    """A server.host / server.port override that no local server of `urls` would use: local servers
    are started on their URL's host and port, so name the conflict instead of ignoring the key."""
    local = [urlparse(u) for u in urls if is_local(u)]
    problems = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in ADDRESS_KEYS or not local:
            continue
        have = {str(u.port or 80) for u in local} if key == "server.port" else {u.hostname or "" for u in local}
        if value.strip() not in have:
            problems.append(f"{key}={value}: the servers dlrl {prefix} starts listen where {prefix}.servers says "
                            f"({', '.join(u.geturl() for u in local)}); drop {key}, or put the address in "
                            f"{prefix}.servers (e.g. servers=[http://127.0.0.1:{value if key == 'server.port' else 8000}])")
    return problems


class LocalServer:
    """A `dlrl serve` subprocess owned by the trainer."""

    def __init__(self, url: str, config_path: str | None, model: str, overrides: list[str], token: str,
                 log_path: Path):
        cmd = serve_command(url, config_path, model, overrides)
        env = dict(os.environ, DLRL_ADMIN_TOKEN=token)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
            env.pop(key, None)  # the server is not a rank of the trainer's job
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.log_file = open(log_path, "ab")
        log.info("no server at %s: starting one (log: %s)", url, log_path)
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self.url = url

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log_file.close()


def new_token() -> str:
    return secrets.token_urlsafe(24)


def read_token_file(path: str | Path) -> str:
    p = Path(path)
    return p.read_text().strip() if p.is_file() else ""


def resolve_token(cfg: Any, server: Any) -> str:
    """The admin token the trainer pushes with: train.admin_token, env DLRL_ADMIN_TOKEN, then
    the config's server.admin_token / server.admin_token_file (`server`: the ServerKeys view)."""
    if cfg.admin_token:
        return cfg.admin_token
    if os.environ.get("DLRL_ADMIN_TOKEN"):
        return os.environ["DLRL_ADMIN_TOKEN"]
    if server.admin_token:
        return server.admin_token
    return read_token_file(server.admin_token_file) if server.admin_token_file else ""
