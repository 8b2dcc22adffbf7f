"""Lifelines between the processes of one `dlrl serve`: who notices when another dies.

    die_with_parent(parent_pid)                   # a child: SIGTERM when the supervisor dies, even by SIGKILL
    cancel = watch_pid(loop, pid, on_exit)        # on_exit() on the loop once process `pid` has exited

`watch_pid` opens a pidfd (Linux >= 5.3: it becomes readable when the process exits, whoever its
parent is) and waits for it on the event loop; without pidfds it polls every `POLL_S`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
from collections.abc import Callable

log = logging.getLogger("dlrl.server")
PR_SET_PDEATHSIG = 1
POLL_S = 0.25


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when its parent dies; exit now if it already did."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the supervisor's own shutdown still reaches it
        pass
    if os.getppid() != parent_pid:
        raise SystemExit(f"dlrl serve: the supervising process {parent_pid} is gone")


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_pid(loop: asyncio.AbstractEventLoop, pid: int, on_exit: Callable[[], None]) -> Callable[[], None]:
    """Call `on_exit()` (once, on `loop`) when process `pid` exits; returns a function that stops watching."""
    fired = False

    def fire() -> None:
        nonlocal fired
        if not fired:
            fired = True
            stop()
            on_exit()

    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds (old kernel, not Linux): poll
        handle: list[asyncio.TimerHandle] = []

        def poll() -> None:
            if is_alive(pid):
                handle[:] = [loop.call_later(POLL_S, poll)]
            else:
                fire()

        def stop_polling() -> None:
            for h in handle:
                h.cancel()

        stop = stop_polling
        poll()
        return stop

    closed = False

    def stop_fd() -> None:
        nonlocal closed
        if closed:
            return
        closed = True
        try:
            loop.remove_reader(fd)
        except (ValueError, RuntimeError):  # the loop is closed already
            pass
        try:
            os.close(fd)
        except OSError:
            pass

    stop = stop_fd
    loop.add_reader(fd, fire)
    return stop


__all__ = ["die_with_parent", "is_alive", "watch_pid"]
