"""Wait, bounded, until servers answer GET /ready; a server whose process has exited ends the wait at once.

    wait_ready(urls, timeout=300, exited=lambda url: procs[url].poll() is not None)  # from Python
    python -m rollout_client.ready --timeout 600 http://127.0.0.1:8000=4242 ...     # url=pid (deploy/local/run.sh)

The command form watches each pid through /proc (a zombie counts as exited: the shell that started
it reaps it later) and exits 1 with a message naming the url (`--name` prefixes it, e.g. run.sh).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import httpx

WAIT_LOG_S = 15.0  # the command's line about a wait at least this often


class ServerExited(RuntimeError):
    """The process behind a url exited before the server became ready."""


def is_ready(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(url.rstrip("/") + "/ready", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(urls: Sequence[str], timeout: float, exited: Callable[[str], bool] | None = None,
               interval: float = 0.2, on_wait: Callable[[str, float], None] | None = None,
               wait_log_s: float = WAIT_LOG_S) -> None:
    """Return once every url answers /ready with 200; ServerExited as soon as `exited(url)`,
    TimeoutError past `timeout` seconds (both name the url). `on_wait(url, seconds so far)` is
    called every `wait_log_s` while a url is not ready (the command prints a line: no silent wait)."""
    t0 = time.monotonic()
    deadline, next_log = t0 + timeout, t0 + wait_log_s
    for url in urls:
        while not is_ready(url):
            if exited is not None and exited(url):
                raise ServerExited(f"the server for {url} exited (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready in time")
            if on_wait is not None and time.monotonic() >= next_log:
                next_log = time.monotonic() + wait_log_s
                on_wait(url, time.monotonic() - t0)
            time.sleep(interval)


def pid_exited(pid: int) -> bool:
    """True when `pid` is gone or a zombie."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollout_client.ready", description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for all of them (default 600)")
    ap.add_argument("--name", default="rollout_client.ready", help="prefix of the error message")
    ap.add_argument("servers", nargs="+", metavar="URL=PID", help="a server's url and the pid of its process")
    args = ap.parse_args(argv)
    pids: dict[str, int] = {}
    for item in args.servers:
        url, _, pid = item.rpartition("=")
        if not url or not pid.isdigit():
            ap.error(f"{item!r} is not URL=PID")
        pids[url] = int(pid)
    def say(url: str, seconds: float) -> None:
        print(f"{args.name}: waiting for {url} to be ready ({seconds:.0f} s so far, at most {args.timeout:.0f} s)",
              file=sys.stderr, flush=True)

    try:
        wait_ready(list(pids), args.timeout, exited=lambda url: pid_exited(pids[url]), on_wait=say)
    except (ServerExited, TimeoutError) as e:
        print(f"{args.name}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
