"""Executors: one bounded thread pool per kind of blocking work, so that one kind that hangs
(a store outage) cannot hold the threads another kind needs (an admin weight push).

    pools = Executors.from_config(config)               # server.api.app: ServerState.executors
    is_new = await pools.run_store(recorder.add_feedback, rid, 1.0, None)   # feedback / store I/O
    digest = await pools.run_weights(receiver.digest)                       # weight-update work
    pools.install_default(asyncio.get_running_loop())   # everything else (asyncio.to_thread)
    pools.shutdown()

- `store`: POST /v1/feedback's store calls, `server.store_threads` threads (4). A hung store
  holds at most these; the calls behind them wait, and past `server.max_concurrent_feedback`
  (64 by default) feedback is refused 429 before its body is read (server.api.gate).
- `weights`: the weight-update glue's blocking calls (server.weights.weight_updates: connect, begin,
  bucket checks, verify, abort, the served digest, keeping a version), `server.weight_threads` (4).
- the loop's default executor, for everything else (`asyncio.to_thread`: e.g. the engine's
  copy of new weights), `server.default_threads` (4).
The prompt tokenizer has its own worker already (server.api.prompts).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from server.config import ServerConfig

P = ParamSpec("P")
T = TypeVar("T")


async def run_in(pool: ThreadPoolExecutor | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` in `pool` (None: the loop's default executor), awaited."""
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))


class Executors:
    def __init__(self, store_threads: int = 4, weight_threads: int = 4, default_threads: int = 4):
        self.store = ThreadPoolExecutor(store_threads, thread_name_prefix="dlrl-store")
        self.weights = ThreadPoolExecutor(weight_threads, thread_name_prefix="dlrl-weights")
        self.default_threads = default_threads
        self._default: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, config: ServerConfig) -> Executors:
        return cls(config.store_threads, config.weight_threads, config.default_threads)

    async def run_store(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await run_in(self.store, fn, *args, **kwargs)

    async def run_weights(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await run_in(self.weights, fn, *args, **kwargs)

    def install_default(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make a bounded pool of `default_threads` the loop's default executor (server.api.app's lifespan)."""
        self._default = ThreadPoolExecutor(self.default_threads, thread_name_prefix="dlrl-default")
        loop.set_default_executor(self._default)

    def shutdown(self) -> None:
        """Stop taking work; threads still blocked (a hung store) are not waited for."""
        for pool in (self.store, self.weights, self._default):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["Executors", "run_in"]
