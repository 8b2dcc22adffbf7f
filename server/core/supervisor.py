"""Supervisor: what `dlrl serve` runs by default -- the engine core and the API processes, started and stopped as one.

    code = Supervisor(config, model_path).run()     # server.cli: blocks until stopped; the exit status

    dlrl serve (this process: binds the port, watches the others)
      |- engine core   (server.core.process core): model, KV cache, scheduler, runner, weight receiver
      |- API process 0 (server.core.process api): HTTP on the shared listening socket
      |- ...           (server.api_processes of them)

Start: the listening socket is bound first (a busy port is an error before anything loads), then the
engine core and the API processes start together (each API process is handed the socket and the core's
pid, and says hello once the core listens); the core's load errors are `dlrl serve`'s (exit 2), and
`dlrl serve` is ready when they all are.
Stop (SIGTERM / SIGINT, once): every API process drains (new requests 503, those in flight finish,
up to `server.shutdown_timeout`, then aborted) and exits; then the engine core stops; exit 0. A
second signal stops the API processes at once. The channel's socket folder is removed at the end.
An API process that dies is started again (its requests were aborted by the core, which serves the
others meanwhile); more than `MAX_RESTARTS` in `RESTART_WINDOW_S` stops everything (exit 1). If the
engine core dies, its API processes answer 503 naming it and exit non-zero; so does `dlrl serve`
(exit 1), after stopping whatever is left: no process outlives it (every child also has a
parent-death signal) and the engine core's exit leaves no shared-memory segment of its own.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType

from server.config import ServerConfig
from server.core.channel import core_address, make_run_dir, remove_run_dir

log = logging.getLogger("dlrl.server")
POLL_S = 0.1
START_TIMEOUT_S = 3600.0  # loading a model (and compiling) may take long; the core's exit is seen at once
MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0
STOP_GRACE_S = 15.0  # past an API process's shutdown_timeout (abort grace + uvicorn's own)
CORE_STOP_S = 30.0


class StartFailed(RuntimeError):
    """A child could not start: its message (a configuration error is exit 2)."""


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """The listening socket every API process accepts on (inherited by them)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


@dataclass(eq=False)
class Child:
    name: str
    proc: subprocess.Popen
    ready_fd: int  # read end of its ready pipe
    ready: bool = False


class Supervisor:
    def __init__(self, config: ServerConfig, model_path: str):
        self.config, self.model_path = config, model_path
        self.run_dir = make_run_dir()
        self.address = core_address(self.run_dir)
        self.apis: dict[int, Child] = {}
        self.restarts: list[float] = []
        self.signals = 0
        self.first_signal = 0
        self.core: Child | None = None

    # ------------------------------------------------------------------ children
    def _spawn(self, name: str, args: list[str], pass_fds: tuple[int, ...] = ()) -> Child:
        r, w = os.pipe()
        cmd = [sys.executable, "-m", "server.core.process", *args, "--address", self.address, "--ready-fd", str(w),
               "--parent", str(os.getpid())]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(w, *pass_fds), process_group=0)
        os.close(w)
        assert proc.stdin is not None
        proc.stdin.write(self.config.model_dump_json().encode())  # tokens on a pipe, never on the command line
        proc.stdin.close()
        return Child(name, proc, r)

    def _wait_ready(self, children: list[Child], timeout: float) -> None:
        """Until each child wrote its ready line; StartFailed with its error (or its exit)."""
        deadline = time.monotonic() + timeout
        for child in children:
            while not child.ready:
                if self.signals:
                    raise StartFailed("stopped by a signal while starting")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StartFailed(f"{child.name} did not start within {timeout:g}s")
                readable, _, _ = select.select([child.ready_fd], [], [], min(left, POLL_S))
                if readable:
                    line = os.read(child.ready_fd, 65536).decode(errors="replace").strip()
                    info = json.loads(line.splitlines()[0]) if line else {"error": f"{child.name} exited at start "
                                                                          f"(status {child.proc.wait()})"}
                    if "error" in info:
                        raise StartFailed(info["error"])
                    child.ready = True
                    os.close(child.ready_fd)

    def _start_api(self, index: int, listen_fd: int, core_pid: int) -> Child:
        child = self._spawn(f"API process {index}", ["api", "--index", str(index), "--core-pid", str(core_pid),
                                                     "--listen-fd", str(listen_fd)], (listen_fd,))
        self.apis[index] = child
        return child

    # ------------------------------------------------------------------ run
    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        self.first_signal = self.first_signal or sig

    def run(self) -> int:
        from server.api.auth import resolve_admin_token

        # once, here: a token file created on first start must not be created by each API process
        self.config = self.config.model_copy(update={"admin_token": resolve_admin_token(
            self.config.admin_token, self.config.admin_token_file)})
        c = self.config
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            sock = listen_socket(c.host, c.port, c.listen_backlog)
        except OSError as e:
            print(f"dlrl serve: error: server.port / --port: cannot listen on {c.host}:{c.port}: {e}", file=sys.stderr)
            return 2
        try:
            return self._serve(sock)
        except StartFailed as e:
            print(f"dlrl serve: error: {e}", file=sys.stderr, flush=True)
            self._stop_all()
            return 0 if self.signals else 2
        finally:
            sock.close()
            remove_run_dir(self.run_dir)

    def _serve(self, sock: socket.socket) -> int:
        c = self.config
        self.core = self._spawn("the engine core", ["core", "--model", self.model_path])
        for i in range(c.api_processes):  # they start while the core loads the model, and wait for it
            self._start_api(i, sock.fileno(), self.core.proc.pid)
        self._wait_ready([self.core], START_TIMEOUT_S)
        self._wait_ready(list(self.apis.values()), 300.0)
        host, port = sock.getsockname()[:2]
        log.info("listening on http://%s:%d (admin endpoints %s): engine core pid %d, %d API process(es) pid %s", host,
                 port, "enabled" if c.admin_token else "disabled: no admin token", self.core.proc.pid, len(self.apis),
                 ", ".join(str(a.proc.pid) for a in self.apis.values()))
        return self._watch(sock)

    def _watch(self, sock: socket.socket) -> int:
        assert self.core is not None
        while True:
            if self.signals:
                return self._shutdown()
            code = self.core.proc.poll()
            if code is not None:
                log.error("the engine core (pid %d) exited with %s: stopping the API processes (exit 1)",
                          self.core.proc.pid, _status(code))
                self._stop_all(wait_s=CORE_STOP_S)
                return 1
            for index, child in list(self.apis.items()):
                code = child.proc.poll()
                if code is None:
                    continue
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if t > now - RESTART_WINDOW_S] + [now]
                if len(self.restarts) > MAX_RESTARTS:
                    log.error("API process %d exited with %s; %d restarts within %gs: stopping (exit 1)", index,
                              _status(code), MAX_RESTARTS, RESTART_WINDOW_S)
                    self._stop_all()
                    return 1
                log.warning("API process %d (pid %d) exited with %s: starting it again (the engine core serves the "
                            "others meanwhile)", index, child.proc.pid, _status(code))
                try:
                    self._wait_ready([self._start_api(index, sock.fileno(), self.core.proc.pid)], 300.0)
                except StartFailed as e:
                    log.error("API process %d could not start again: %s", index, e)
            time.sleep(POLL_S)

    def _shutdown(self) -> int:
        """Drain the API processes, then stop the engine core."""
        log.info("received %s: shutting down gracefully: %d API process(es) drain (up to server.shutdown_timeout=%gs), "
                 "then the engine core", signal.Signals(self.first_signal).name, len(self.apis),
                 self.config.shutdown_timeout)
        sent = self.signals
        for child in self.apis.values():
            _signal(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_timeout + STOP_GRACE_S
        while any(a.proc.poll() is None for a in self.apis.values()) and time.monotonic() < deadline:
            if self.signals > sent:  # a second signal: stop at once
                sent = self.signals
                for child in self.apis.values():
                    _signal(child.proc, signal.SIGTERM)
            time.sleep(POLL_S)
        core_died = self.core is not None and self.core.proc.poll() is not None
        self._stop_all(wait_s=CORE_STOP_S)
        return 1 if core_died else 0

    def _stop_all(self, wait_s: float = 10.0) -> None:
        """SIGTERM to whatever is left (API processes first, then the core); SIGKILL past `wait_s`."""
        for group in ([a.proc for a in self.apis.values()], [self.core.proc] if self.core is not None else []):
            for proc in group:
                _signal(proc, signal.SIGTERM)
            deadline = time.monotonic() + wait_s
            for proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.error("pid %d did not stop within %gs: killed", proc.pid, wait_s)
                    proc.kill()
                    proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"


__all__ = ["StartFailed", "Supervisor", "listen_socket"]
