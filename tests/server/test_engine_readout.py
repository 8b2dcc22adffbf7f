"""EngineReadout (server.engine.readout): the Engine and CoreClient, its mirror in an API process, answer
state / is_running / is_paused / the counts / max_model_len the same way, each from its own sources; the
client says "stopped" once its core is gone (is_paused: what the core said last).

    .venv/bin/python -m pytest -q tests/server/test_engine_readout.py
"""

from __future__ import annotations

import asyncio

from server.core import messages as m
from server.core.client import CoreClient
from server.engine.engine import Engine, EngineState
from tests.server.test_server_scheduler import FakeBackend


def load(state: str, num_running: int = 2, num_waiting: int = 3) -> m.Load:
    return m.Load(0.0, 4, state, "tiny", num_running, num_waiting, waiting_tokens=30, num_free_slots=1,
                  free_pages=0)


def client(state: str) -> CoreClient:
    """A client that never connected, its core's facts and last load set as a Welcome / an Outputs would."""
    c = CoreClient("ipc:///nowhere")
    c.load = load(state)
    c.backend = m.RunnerFacts("fake", 1, 10, 1, max_batch=2, max_len=64, has_top_logprobs=False, family="sdar",
                              cache_mode=None)
    return c


def test_the_engine_reads_its_thread_state_and_scheduler():
    engine = Engine(FakeBackend())
    assert engine.state is EngineState.RUNNING and not engine.is_running  # not started: no thread
    assert not engine.is_paused and (engine.num_running, engine.num_waiting, engine.max_model_len) == (0, 0, 64)
    engine.start()
    try:
        assert engine.is_running
        asyncio.run(engine.pause())
        assert engine.is_paused and engine.is_running and engine.state == "paused"
    finally:
        engine.shutdown()
    assert engine.state is EngineState.STOPPED and not engine.is_running and not engine.is_paused


def test_the_client_reads_the_cores_last_load_and_its_life():
    c = client("running")
    assert (c.state, c.is_running, c.is_paused) == ("running", True, False)
    assert (c.num_running, c.num_waiting, c.max_model_len) == (2, 3, 64)
    c.load = load("paused", num_running=0, num_waiting=5)
    assert (c.state, c.is_running, c.is_paused, c.num_running, c.num_waiting) == ("paused", True, True, 0, 5)
    c.load = load("stopped")
    assert (c.state, c.is_running, c.is_paused) == ("stopped", False, False)


def test_a_gone_core_is_stopped_whatever_it_said_last():
    c = client("paused")
    c.core_gone("the engine core process (pid 1) exited")
    assert c.state == EngineState.STOPPED and not c.is_running
    assert c.is_paused and (c.num_running, c.num_waiting) == (2, 3)  # the last load's, as before it died
