"""Finding, starting and stopping the generation servers the trainer talks to.

If no server answers at the configured address (and `train.start_server` is on), the
trainer starts `dlrl serve` as a subprocess on that host/port with an admin token it
generated, waits until it is ready, and stops it at the end. The trainer never imports
the server package: they only meet over HTTP and weight_sync.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

log = logging.getLogger("dlrl.train")


def is_alive(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(f"{url.rstrip('/')}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server at {url} exited with code {proc.returncode} before becoming ready")
        try:
            if httpx.get(f"{url.rstrip('/')}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"servers: {url} unreachable/not ready after {timeout:.0f}s")


def read_token_file(path: str | Path) -> str:
    p = Path(path)
    return p.read_text().strip() if p.is_file() else ""


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
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(log_path, "ab")
        log.info("no server at %s: starting one (log: %s)", url, log_path)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = url

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log_file.close()


def ensure_servers(cfg, config_path: str | None, overrides: list[str], token: str,
                   out_dir: Path) -> list[LocalServer]:
    """Check every configured server; start the missing ones locally when allowed."""
    started = []
    try:
        for i, url in enumerate(cfg.servers):
            if is_alive(url):
                wait_ready(url, cfg.server_start_timeout)
                continue
            host = urlparse(url).hostname
            if not cfg.start_server or host not in ("127.0.0.1", "localhost"):
                raise RuntimeError(f"servers: {url} is unreachable (start it with `dlrl serve`, "
                                   "or set train.start_server=true for a local address)")
            srv = LocalServer(url, config_path, cfg.model, overrides, token, out_dir / f"server{i}.log")
            started.append(srv)
            wait_ready(url, cfg.server_start_timeout, srv.proc)
    except BaseException:
        for s in started:
            s.stop()
        raise
    return started


def new_token() -> str:
    return secrets.token_urlsafe(24)
