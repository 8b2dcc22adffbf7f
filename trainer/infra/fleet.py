"""ServerFleet: the generation servers as the trainer sees them, through ONE client.

    fleet = ServerFleet(["http://h1:8000", "http://h2:8000"], token)
    fleet.start_missing(start_server=True, launch=lambda url, i: LocalServer(...))  # local only
    fleet.wait_ready(timeout=600)
    rollouts = fleet.generate(prompt_ids, n=8, seed=7, max_tokens=64)   # least-loaded over servers
    fleet.versions()  -> {url: version}        fleet.digests() -> {url: digest}     fleet.names() -> {url: model}
    fleet.push(source, version=8, transport="shm")   # every server, or an error naming the failed one
    fleet.close()

Generation, readiness and admin calls all go through one `rollout_client.RolloutClient` that
lives on one event loop (a thread owned by the fleet) for the whole run: no new loop or
client per batch. The weight data plane is `weight_sync` (one sender per server set, kept
open across pushes). Only rank 0 uses the control plane; every rank may generate.

The three views of "the servers": this module is the CLIENT of the servers a run generates
on (wherever they run); trainer/infra/local_servers.py holds the PROCESSES the trainer starts itself
on this machine when none answers (`start_missing` launches them); trainer/align/replicas.py is
`dlrl align`'s SERVING replicas (a separate pool that only receives promoted versions), one
ServerFleet per replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_client.client import AdminError, Prompt, RolloutClient
from rollout_client.protocol.rollout import Rollout
from trainer.infra.local_servers import is_local
from weight_sync.errors import ServerRestarted, WeightSyncError

if TYPE_CHECKING:
    from weight_sync import WeightSender

log = logging.getLogger("dlrl.train")
T = TypeVar("T")
WAIT_LOG_S = 10.0  # a line about a wait for servers at least this often


def last_line(path: Path, max_bytes: int = 4096) -> str:
    """The last non-empty line of a (log) file, shortened to 300 characters; "" when unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


class FleetError(RuntimeError):
    """A server misbehaved; the message names it. `restarted`: the servers that restarted during
    the call (they lost what it sent them; the caller may wait for them and send it again)."""

    def __init__(self, message: str, restarted: list[str] | None = None) -> None:
        super().__init__(message)
        self.restarted = restarted or []


async def _gather(*coros: Coroutine[Any, Any, Any], return_exceptions: bool = False) -> list[Any]:
    return await asyncio.gather(*coros, return_exceptions=return_exceptions)


class _LoopThread:
    """One asyncio loop in a daemon thread; `run(coro)` from any thread waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleet-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class ServerFleet:
    def __init__(self, urls: list[str], token: str, *, timeout: float = 600.0, max_retries: int = 5,
                 sync_options: dict[str, Any] | None = None) -> None:
        if not urls:
            raise ValueError("train.servers: need at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.token = token
        self.sync_options = dict(sync_options or {})
        self.local: list[Any] = []  # LocalServer processes this fleet started
        self._loop = _LoopThread()
        self.client: RolloutClient = self._loop.run(self._make_client(timeout, max_retries))
        self._senders: dict[tuple[str, ...], WeightSender] = {}

    async def _make_client(self, timeout: float, max_retries: int) -> RolloutClient:
        return RolloutClient(self.urls, timeout=timeout, max_retries=max_retries, policy="least_loaded",
                             token=self.token)

    # ------------------------------------------------------------------ lifecycle
    def start_missing(self, start_server: bool, launch: Callable[[str, int], Any]) -> None:
        """Start a local server (`launch(url, index)`) for every configured one that does not answer."""
        health = self._loop.run(self.client.health())
        for i, url in enumerate(self.urls):
            if health[url] is not None:
                continue
            if not start_server or not is_local(url):
                raise FleetError(f"servers: {url} is unreachable (start it with `dlrl serve`, "
                                 "or set train.start_server=true for a local address)")
            self.local.append(launch(url, i))

    def wait_ready(self, timeout: float, urls: list[str] | None = None, log_every_s: float = WAIT_LOG_S) -> None:
        """Wait until the servers answer /ready; a local server that exits is an error naming it. Never
        silent: after `log_every_s` (and again every `log_every_s`) one line says which servers it waits
        for, for how long so far and at most, and the last line of the log of those this run started."""
        pending = list(urls or self.urls)
        t0 = time.monotonic()
        deadline, next_log = t0 + timeout, t0 + log_every_s
        while pending:
            for srv in self.local:
                if srv.url.rstrip("/") in pending and srv.exited() is not None:
                    raise FleetError(f"server at {srv.url} exited with code {srv.exited()} before becoming "
                                     f"ready (log: {srv.log_path})")
            ready = self._loop.run(_gather(*(self.client.is_ready(u) for u in pending)))
            pending = [u for u, ok in zip(pending, ready) if not ok]
            if pending and time.monotonic() > deadline:
                raise FleetError(f"servers: {', '.join(pending)} unreachable/not ready after {timeout:.0f}s")
            if pending and time.monotonic() >= next_log:
                next_log = time.monotonic() + log_every_s
                log.info("waiting for %s to be ready (%.0f s so far, at most %.0f s)%s", ", ".join(pending),
                         time.monotonic() - t0, timeout, self._last_lines(pending))
            if pending:
                time.sleep(0.25)

    def _last_lines(self, urls: list[str]) -> str:
        """'; http://... (log PATH): <its log's last line>' for the servers of `urls` this fleet started."""
        return "".join(f"; {srv.url} (log {srv.log_path}): {last_line(srv.log_path) or 'no output yet'}"
                       for srv in self.local if srv.url.rstrip("/") in urls)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        try:
            self._loop.run(self.client.aclose())
        finally:
            self._loop.close()
        for srv in self.local:
            srv.stop()
        self.local = []

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Prompt], n: int, **sampling: Any) -> list[Rollout]:
        return self._loop.run(self.client.generate(prompts, n=n, return_trace=True, **sampling))

    def metrics(self, url: str) -> str:
        """One server's Prometheus metrics (text exposition)."""
        return self._loop.run(self.client.metrics(url))

    # ------------------------------------------------------------------ admin (rank 0)
    def admin(self, url: str, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        return self._loop.run(self.client.admin(url, method, path, body))

    def _each(self, path: str, key: str, urls: list[str] | None = None) -> dict[str, Any]:
        urls = list(urls or self.urls)
        coros = [self.client.admin(u, "GET", path) for u in urls]
        answers = self._loop.run(_gather(*coros, return_exceptions=True))
        out = {}
        for url, a in zip(urls, answers):
            if isinstance(a, BaseException):
                raise FleetError(str(a)) from a
            out[url] = a[key]
        return out

    def versions(self, urls: list[str] | None = None) -> dict[str, int]:
        return {u: int(v) for u, v in self._each("/weights/version", "version", urls).items()}

    def digests(self, urls: list[str] | None = None) -> dict[str, str]:
        return self._each("/weights/checksum", "digest", urls)

    def names(self) -> dict[str, str | None]:
        """The model name each server reports in /health (None: unreachable)."""
        health = self._loop.run(self.client.health())
        return {u: (h.model if h is not None else None) for u, h in health.items()}

    def rename(self, name: str, urls: list[str]) -> None:
        """Make `urls` report the model as `name` (/health, /v1/models; POST /admin/model_name)."""
        for url in urls:
            self.admin(url, "POST", "/admin/model_name", {"name": name})

    def served_dtype(self) -> str | None:
        return self.admin(self.urls[0], "GET", "/weights/version").get("dtype")

    def unreachable(self) -> list[str]:
        health = self._loop.run(self.client.health())
        return [u for u, h in health.items() if h is None]

    # ------------------------------------------------------------------ weights (rank 0)
    def _sender(self, urls: list[str] | None) -> WeightSender:
        """One weight_sync sender per set of servers, kept for the run (its shm region, dist group
        and the servers' staging are set up once, at connect)."""
        key = tuple(urls or self.urls)
        sender = self._senders.get(key)
        if sender is None:
            from weight_sync import WeightSender  # torch: only once weights move (not in --help / --check)

            opts = self.sync_options
            sender = self._senders[key] = WeightSender(
                list(key), transport=opts.get("transport", "shm"), token=self.token, dtype="auto",
                timeout=float(opts.get("timeout", 300.0)), dist_addr=opts.get("dist_addr", "127.0.0.1"),
                run_id=opts.get("run_id"), ipc_allow_cpu=bool(opts.get("ipc_allow_cpu", False)))
        return sender

    def connect(self, source: Any) -> dict[str, Any]:
        """Set the data plane up for tensors shaped like `source` (so the first push is as fast as
        the rest): region / group created, server staging allocated."""
        try:
            return self._sender(None).connect(source)
        except (WeightSyncError, AdminError) as e:
            raise FleetError(f"weight sync connect failed: {e}") from e

    def push(self, source: Any, version: int, urls: list[str] | None = None) -> dict[str, Any]:
        """Push `source` (weight_sync source) as `version` into `urls` (default: all servers).
        Each server applies it whole or not at all; an error names the servers that failed."""
        key = tuple(urls or self.urls)
        sender = self._sender(list(key))
        try:
            return sender.push(source, version)
        except (WeightSyncError, AdminError) as e:
            dead = [u for u in key if u in self.unreachable()]
            where = f" (unreachable: {', '.join(dead)})" if dead else ""
            restarted = [e.url] if isinstance(e, ServerRestarted) else []
            raise FleetError(f"push of version {version} failed{where}: {e}", restarted=restarted) from e
