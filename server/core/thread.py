"""CoreThread: the engine core on a thread of this process (`server.engine_core=thread`, the tests' servers).

    core = CoreThread(engine, config)      # server.api.app.create_app: the app of an Engine built here
    core.start()                           # its own event loop on a thread; the channel bound on core.address
    core.on_exit(callback)                 # told when it stops (normally, or because it failed)
    core.stop()                            # the engine shut down, the thread joined, the socket folder removed

The same EngineCore as in the engine-core process (server.core.engine_core) and the same channel:
the API side (server.core.client) cannot tell them apart. What differs is only that the step loop
shares this process's interpreter with HTTP, as it did before the split (one process; tests reach the
Engine directly).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
from collections.abc import Callable

from server.config import ServerConfig
from server.core.channel import core_address, make_run_dir, remove_run_dir
from server.core.engine_core import EngineCore
from server.engine.engine import Engine

log = logging.getLogger("dlrl.server")


class CoreThread:
    def __init__(self, engine: Engine, config: ServerConfig, model_path: str = ""):
        self.core = EngineCore(engine, config, model_path)
        self.run_dir = make_run_dir()
        atexit.register(remove_run_dir, self.run_dir)  # a daemon thread may not get to its own cleanup
        self.address = core_address(self.run_dir)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._exit: list[Callable[[], None]] = []
        self.stopping = False  # stop() was called: its end is expected
        self._thread = threading.Thread(target=self._run, name="dlrl-core", daemon=True)

    def start(self, timeout: float = 60.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the engine core did not start within {timeout:g}s")
        if self._error is not None:
            raise RuntimeError(f"the engine core failed to start: {self._error}") from self._error

    def on_exit(self, fn: Callable[[], None]) -> None:
        self._exit.append(fn)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            asyncio.run(self.core.serve(self.address, self._ready.set))
        except BaseException as e:  # pragma: no cover - a bug; the API side hears of it (on_exit)
            self._error = e
            log.exception("engine core thread failed")
        finally:
            self._ready.set()
            remove_run_dir(self.run_dir)
            for fn in self._exit:
                try:
                    fn()
                except Exception:
                    log.exception("engine core exit callback failed")

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping = True
        self.core.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)


__all__ = ["CoreThread"]
