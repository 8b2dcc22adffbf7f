"""EngineReadout: the engine's state as server.api reads it (/health, /admin/status, the metrics gauges), in one place.

    class Engine(EngineReadout): ...       # server.engine.engine: its own state, its thread, its Scheduler
    class CoreClient(EngineReadout): ...   # server.core.client: the core's last load, the core's life

Both answer the same questions -- what state is it in, is it running, is it paused, how many sequences run and
wait, how long may a sequence be -- from what each knows its own way: the last state it set or heard of
(`_last_state`), whether what decodes is alive (`_alive`: the engine's thread; the engine core, for an API
process), where its sequences are counted (`_counts`: the Engine's scheduler; the core's last load) and a
`backend` with the runner's limits. The answers are derived from them
here; a class only changes an answer where it must (CoreClient.state: "stopped" once its core is gone, whatever
the core said last).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol


class EngineState(StrEnum):
    RUNNING = "running"  # admitting and decoding
    PAUSED = "paused"    # admission stopped; running sequences finish (or are aborted), then drained
    STOPPED = "stopped"  # shut down (or the engine thread died): no new requests; pause/resume are no-ops


class QueueCounts(Protocol):
    """The counts the readout reads: the Engine's Scheduler, or the core's last load (CoreClient)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...


class Limits(Protocol):
    """What the readout reads of a runner: the Engine's Runner, or CoreClient's RunnerFacts of the core's."""

    @property
    def max_len(self) -> int: ...


class EngineReadout:
    """The read-only state of an engine, derived from `_last_state()`, `_alive()`, `_counts()` and `backend`'s
    limits."""

    backend: Limits

    def _last_state(self) -> str:
        """The state this engine was last put in (an EngineState value), alive or not."""
        raise NotImplementedError

    def _alive(self) -> bool:
        """Whether what decodes (the engine thread, the engine core) is alive."""
        raise NotImplementedError

    def _counts(self) -> QueueCounts:
        """Where the running and waiting sequences are counted."""
        raise NotImplementedError

    @property
    def state(self) -> str:
        return self._last_state()

    @property
    def is_running(self) -> bool:
        """Alive and not stopped: it takes new requests."""
        return self._alive() and self._last_state() != EngineState.STOPPED

    @property
    def is_paused(self) -> bool:
        return self._last_state() == EngineState.PAUSED

    @property
    def max_model_len(self) -> int:
        """Prompt + completion tokens a sequence may reach (the runner's `max_len`)."""
        return self.backend.max_len

    @property
    def num_running(self) -> int:
        return self._counts().num_running

    @property
    def num_waiting(self) -> int:
        return self._counts().num_waiting


__all__ = ["EngineReadout", "EngineState", "Limits", "QueueCounts"]
