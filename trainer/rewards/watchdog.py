"""Resource limits that hold for a whole process tree: one thread watches every running sandbox.

    verdict = WATCHDOG.watch(root_pid, limits)   # {} until it kills: {"killed": "memory" | "cpu"}
    ...
    WATCHDOG.unwatch(root_pid)

Every `interval` seconds it maps parent -> children over all processes once (psutil), then for
each watched root sums resident memory and CPU time (user + system, reaped children included)
over the root's descendants, and SIGKILLs every process of a tree over `limits.memory_mb` or
`limits.cpu_s`. Descendants are found by parentage, which `setsid` does not change; a process
orphaned inside a bwrap sandbox is re-parented to the sandbox's init, so it stays in the tree.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass

import psutil

logger = logging.getLogger("trainer.rewards")


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0       # wall-clock deadline of a whole run
    cpu_s: float = 10.0        # CPU seconds summed over each sandbox's process tree
    memory_mb: int = 1024      # resident memory summed over the tree; also RLIMIT_AS per process
    max_processes: int = 32    # processes + threads per sandbox (RLIMIT_NPROC in its user namespace)
    file_size_mb: int = 16     # largest file a program may write (RLIMIT_FSIZE)
    tmp_size_mb: int = 64      # size of the private /tmp (tmpfs) and of /dev/shm
    max_open_files: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"sandbox {name}: must be > 0, got {value!r}")

    def rlimits(self) -> dict[str, int]:
        cpu = int(self.cpu_s) + 1
        return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": cpu, "RLIMIT_NPROC": self.max_processes,
                "RLIMIT_FSIZE": self.file_size_mb << 20, "RLIMIT_NOFILE": self.max_open_files,
                "RLIMIT_CORE": 0}


class Watchdog:
    """One thread for every running sandbox: each `interval` s it sums resident memory and CPU time
    over each watched process tree and kills a tree over its limits."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._trees: dict[int, tuple[SandboxLimits, dict]] = {}  # root pid -> (limits, verdict)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, pid: int, limits: SandboxLimits) -> dict:
        verdict: dict = {}
        with self._lock:
            self._trees[pid] = (limits, verdict)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="sandbox-watchdog", daemon=True)
                self._thread.start()
        self._wake.set()
        return verdict

    def unwatch(self, pid: int) -> None:
        with self._lock:
            self._trees.pop(pid, None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                trees = dict(self._trees)
            if not trees:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self._check(trees)
            except Exception:  # never let the watchdog die: the next tick tries again
                logger.exception("sandbox watchdog: check failed")
            time.sleep(self.interval)

    @staticmethod
    def _check(trees: dict[int, tuple[SandboxLimits, dict]]) -> None:
        children: dict[int, list[int]] = {}
        for p in psutil.process_iter(["ppid"]):
            children.setdefault(p.info["ppid"], []).append(p.pid)
        for root, (limits, verdict) in trees.items():
            pids = _descendants(root, children)
            mem, cpu = _usage(pids)
            if mem > limits.memory_mb << 20 or cpu > limits.cpu_s:
                verdict["killed"] = "memory" if mem > limits.memory_mb << 20 else "cpu"
                kill_pids(pids)


def _descendants(root: int, children: dict[int, list[int]]) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def _usage(pids: list[int]) -> tuple[int, float]:
    """(resident bytes, CPU seconds incl. reaped children) summed over pids."""
    mem, cpu = 0, 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            with p.oneshot():
                mem += p.memory_info().rss
                t = p.cpu_times()
                cpu += t.user + t.system + t.children_user + t.children_system
    return mem, cpu


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


WATCHDOG = Watchdog()
