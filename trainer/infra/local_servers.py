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
from urllib.parse import urlparse

log = logging.getLogger("dlrl.train")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the process group still lets stop() reach it
        pass


def is_local(url: str) -> bool:
    return urlparse(url).hostname in ("127.0.0.1", "localhost", "::1")


class LocalServer:
    """A `dlrl serve` subprocess owned by the trainer."""

    def __init__(self, url: str, config_path: str | None, model: str, overrides: list[str], token: str,
                 log_path: Path):
        u = urlparse(url)
        cmd = [sys.executable, "-m", "dlrl.cli", "serve", "--host", u.hostname or "127.0.0.1",
               "--port", str(u.port or 80)]
        if config_path:
            cmd += ["--config", str(config_path)]
        if model:
            cmd += [f"server.model={model}"]
        cmd += [o for o in overrides if o.startswith("server.")]
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
