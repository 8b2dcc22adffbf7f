"""`make align`: continuous alignment of the embedded default, end to end on one machine.

    python -m examples.align.local --config configs/align.yaml [--duration 600] [key=value ...]

Starts (all real processes, stopped together at the end or on Ctrl-C / SIGTERM):
- one rollout server (`dlrl serve`, records nothing) at `align.rollout_servers[0]`,
- the serving replicas (`dlrl serve server.record=all`, writing to `align.store`, a feedback token)
  at `align.serving_replicas`,
- the simulated users (`python -m examples.align.users`) on the replicas,
- `dlrl align` with the given overrides (bare keys: `align`; `train.*`, `users.*`, `server.*`).
With `--duration S` `dlrl align` gets SIGTERM after S seconds (it checkpoints and exits 0);
otherwise it runs until it stops by itself (`max_steps`, `max_seconds`) or is interrupted. The
admin and feedback tokens are fresh random ones, given to the processes in their environment (the
admin token also in `align.output_dir/admin_token`, mode 0600, for the console's actions). With
`align.console_port` set it prints the console's URL at start, and one status line per gate verdict,
canary, promotion and rollback (registry events) while the run goes.
Logs: `align.output_dir/logs/`. At the end it prints the version registry and the users' stats.

`LocalAlign` is the same thing as a class (the end-to-end test drives it step by step).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx


class LocalAlign:
    def __init__(self, config: str, overrides: list[str] | None = None, env: dict[str, str] | None = None,
                 align_module: str = "dlrl.cli"):
        from dlrl_config import load_sections
        from trainer.align.config import UsersConfig, align_sections

        self.config, self.overrides = config, list(overrides or [])
        self.align_module = align_module  # run as `python -m MODULE align ...` (a test's fake controller)
        # every section checked before any process starts (ConfigError naming the key)
        self.root = load_sections(config, self.overrides, {**align_sections(), "users": UsersConfig}, primary="align")
        self.cfg = self.root["align"]
        self.out = Path(self.cfg.output_dir)
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.admin_token, self.feedback_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        self.env = {**os.environ, "DLRL_ADMIN_TOKEN": self.admin_token, **(env or {})}
        self.token_file = self.out / "admin_token"  # the console's actions need it: owner-only
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_token + "\n")
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        from trainer.infra.local_servers import _die_with_parent

        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, env=env or self.env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.close()
        self.procs[name] = proc
        return proc

    def _server_cmd(self, url: str, *keys: str) -> list[str]:
        u = urlparse(url)
        passed = [o for o in self.overrides if o.startswith("server.")]
        model = [f"server.model={o.split('=', 1)[1]}" for o in self.overrides if o.startswith("train.model=")]
        return [sys.executable, "-m", "dlrl.cli", "serve", "--config", self.config, "--host", u.hostname or "127.0.0.1",
                "--port", str(u.port or 80), *model, *keys, *passed]

    def start_servers(self, timeout: float = 600.0) -> None:
        """The rollout server(s) and the serving replicas; returns once all answer /ready."""
        env = {**self.env, "OMP_NUM_THREADS": self.env.get("OMP_NUM_THREADS", "1")}
        for i, url in enumerate(self.cfg.rollout_servers):
            self._spawn(f"rollout{i}", self._server_cmd(url, "server.record=none"), env)
        replica_env = {**env, "DLRL_FEEDBACK_TOKEN": self.feedback_token}
        for i, url in enumerate(self.cfg.serving_replicas):
            self._spawn(f"replica{i}", self._server_cmd(url, "server.record=all", f"server.store={self.cfg.store}"),
                        replica_env)
        self.wait_ready(self.cfg.rollout_servers + self.cfg.serving_replicas, timeout)

    def start_replica(self, index: int, timeout: float = 300.0) -> None:
        """(Re)start serving replica `index` (after `stop(f"replica{index}")`)."""
        url = self.cfg.serving_replicas[index]
        env = {**self.env, "OMP_NUM_THREADS": "1", "DLRL_FEEDBACK_TOKEN": self.feedback_token}
        self._spawn(f"replica{index}", self._server_cmd(url, "server.record=all", f"server.store={self.cfg.store}"),
                    env)
        self.wait_ready([url], timeout)

    def wait_ready(self, urls: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(urls)
        while pending:
            for name, proc in self.procs.items():
                if proc.poll() is not None and name.startswith(("rollout", "replica")):
                    tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail}")
            pending = [u for u in pending if not _ready(u)]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"servers not ready after {timeout:.0f}s: {', '.join(pending)}")
            if pending:
                time.sleep(0.3)

    def start_users(self, *overrides: str) -> subprocess.Popen:
        replicas = "[" + ",".join(self.cfg.serving_replicas) + "]"
        keys = [o for o in self.overrides if o.startswith(("users.", "task."))]
        cmd = [sys.executable, str(Path(__file__).with_name("users.py")), "--config", self.config, f"users.replicas={replicas}",
               f"users.stats_path={self.out / 'users.json'}", *keys, *overrides]
        return self._spawn("users", cmd, {**self.env, "DLRL_FEEDBACK_TOKEN": self.feedback_token})

    def start_align(self, *extra: str, resume: bool = False) -> subprocess.Popen:
        keys = [o for o in self.overrides if not o.startswith("users.")]  # server.*: its admin token keys
        cmd = [sys.executable, "-m", self.align_module, "align", "--config", self.config, *keys, *extra]
        return self._spawn("align", cmd + (["--resume"] if resume else []))

    def stop(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 60.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        return proc.returncode

    def stop_all(self) -> None:
        for name in ["align", "users"] + [n for n in self.procs if n not in ("align", "users")]:
            self.stop(name)

    @property
    def console_url(self) -> str:
        return f"http://{self.cfg.console_host}:{self.cfg.console_port}/"

    def follow(self, align: subprocess.Popen, duration: float = 0.0, every_s: float = 2.0) -> bool:
        """Print a status line per registry event (gate verdicts, canaries, promotions, rollbacks)
        until `dlrl align` exits (True) or `duration` seconds pass (False)."""
        from store import open_store
        from trainer.align.registry import NO_PRUNE
        from trainer.align.report import event_line

        deadline = time.monotonic() + duration if duration else None
        last_id, store = 0, None
        while True:
            exited = align.poll() is not None
            try:
                if store is None and Path(self.cfg.store).is_file():
                    store = open_store(self.cfg.store, **NO_PRUNE)
                for e in store.events(after_id=last_id) if store is not None else []:
                    last_id = e["id"]
                    print(event_line(e), flush=True)
            except Exception as e:  # the store is busy or not created yet: the next poll reads it
                print(f"(registry not readable yet: {type(e).__name__})", flush=True)
            if exited or (deadline is not None and time.monotonic() >= deadline):
                if store is not None:
                    store.close()
                return exited
            time.sleep(every_s)

    def users_stats(self) -> dict:
        path = self.out / "users.json"
        return json.loads(path.read_text()) if path.is_file() else {}


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.align.local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/align.yaml")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds before dlrl align gets SIGTERM (0: none)")
    ap.add_argument("--align-module", default="dlrl.cli", help="run `python -m MODULE align` (default dlrl.cli; "
                    "tests.trainer.align.flipping: the tests' controller that trains chosen steps on flipped rewards)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from dllm.embedded.tiny import ensure_default_model
    from dlrl_config import ConfigError

    try:
        stack = LocalAlign(args.config, args.overrides, align_module=args.align_module)
    except ConfigError as e:
        ap.error(str(e))
    if not any(o.startswith("train.model=") for o in args.overrides):  # SFT once, before three servers want it
        ensure_default_model(stack.root["model"], stack.root["task"], stack.root["sft"])
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    code = 1
    try:
        stack.start_servers()
        stack.start_users()
        align = stack.start_align()
        print(f"dlrl align running (log: {stack.logs / 'align.log'}); metrics, curves: {stack.out}", flush=True)
        if stack.cfg.console_port:
            print(f"console: {stack.console_url}  (actions: the admin token in {stack.token_file})",
                  flush=True)
        if not stack.follow(align, args.duration):
            stack.stop("align", grace_s=300)
        code = align.returncode
    except KeyboardInterrupt:
        code = stack.stop("align", grace_s=300) or 0
    finally:
        stack.stop_all()
    from trainer.align.cli import versions_main

    versions_main(["--store", stack.cfg.store])
    print(json.dumps({k: v for k, v in stack.users_stats().items() if k != "accuracy_by_minute"}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
