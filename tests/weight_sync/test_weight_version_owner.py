"""One owner per fact: the served weight version is the engine's, the pushed one the Publisher's.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_version_owner.py

The engine's version is read-only; `Engine.apply_update` (pause -> copy in a worker thread
-> version -> resume) is the one way it changes, for commits and rollbacks alike; the
weight-sync receiver reads it (no copy of its own to reconcile). Real uvicorn servers on
loopback with the real weight routes around an idle real engine, pushed with weight_sync.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from fastapi import FastAPI

from server import routes_weights
from server.state import ServerState, attach
from server.weight_updates import WeightUpdates
from tests.weight_sync.test_weight_sync_transports import TOKEN, FakeEngine, FakeModel, ReceiverServer, make
from trainer.infra.publish import Publisher
from weight_sync import WeightSyncError, push, weights_digest

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_engine_version_is_read_only_and_set_inside_the_window():
    engine = FakeEngine(FakeModel(make(0)))
    with pytest.raises(AttributeError):
        engine.version = 3  # nothing outside the engine writes it
    seen = []

    def copy() -> str:
        seen.append((engine.is_paused, engine.version))  # the copy runs paused, before the version moves
        return "copied"

    assert asyncio.run(engine.apply_update(4, copy)) == "copied"
    assert seen == [(True, 0)] and engine.version == 4 and not engine.is_paused


def test_failed_copy_leaves_version_and_pause_state():
    engine = FakeEngine(FakeModel(make(0)))

    def boom() -> None:
        raise ValueError("copy failed")

    with pytest.raises(ValueError, match="copy failed"):
        asyncio.run(engine.apply_update(1, boom))
    assert engine.version == 0 and not engine.is_paused  # resumed, version untouched
    asyncio.run(engine.pause())  # an admin's pause survives a failed update
    with pytest.raises(ValueError):
        asyncio.run(engine.apply_update(1, boom))
    assert engine.version == 0 and engine.is_paused


def _serve(engine: FakeEngine, **kw) -> FastAPI:
    app = FastAPI()
    attach(app, ServerState(engine, admin_token=TOKEN, weight_updates=WeightUpdates(engine, **kw)))
    app.include_router(routes_weights.router)
    return app


def test_failed_apply_through_the_routes_keeps_weights_version_and_resumes():
    engine = FakeEngine(FakeModel(make(0)))

    def refuse(named) -> None:
        assert engine.is_paused  # the copy runs inside the engine's window
        raise ValueError("disk on fire")

    with ReceiverServer(_serve(engine, apply_fn=refuse)) as srv:
        before = srv.get("/weights/checksum")
        with pytest.raises(WeightSyncError, match="apply failed: disk on fire"):
            push([srv.url], make(1), 1, transport="http", token=TOKEN)
        assert srv.get("/weights/checksum") == before and before["version"] == 0
        assert engine.version == 0 and not engine.is_paused
        assert srv.get("/weights/updates/1")["state"] == "failed"


def test_receiver_reports_the_engines_version_after_a_rollback():
    engine = FakeEngine(FakeModel(make(0)))
    with ReceiverServer(_serve(engine, keep_versions=2)) as srv:
        for v in (1, 2):
            push([srv.url], make(v), v, transport="http", token=TOKEN, run_id="r")
        deadline = time.monotonic() + 10
        while srv.get("/weights/kept")["versions"] != [1, 2]:  # kept after each apply, in a worker thread
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(srv.url + "/weights/rollback", json={"version": 1}, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["previous_version"] == 2, r.text
        # no reconcile step: every report reads the engine's version
        assert engine.version == 1 and srv.get("/weights/version")["version"] == 1
        assert srv.get("/weights/updates/2") == {"version": 2, "state": "applied", "reason": "", "run_id": "r",
                                                 "served_version": 1}
        assert srv.get("/weights/checksum")["digest"] == weights_digest(make(1))
        push([srv.url], make(3), 2, transport="http", token=TOKEN, run_id="r")  # 2 > 1 served: taken again
        assert srv.get("/weights/checksum") == {"version": 2, "digest": weights_digest(make(3))}
        with pytest.raises(WeightSyncError, match="not greater than the current version 2"):
            push([srv.url], make(4), 2, transport="http", token=TOKEN, run_id="r")


def test_publisher_owns_the_pushed_version():
    pub = Publisher(None, None, torch.nn.Linear(1, 1))
    with pytest.raises(AttributeError):
        pub.version = 5  # the align controller and a resume adopt, never assign
    assert pub.adopt(7) and pub.version == 7
    assert not pub.adopt(3) and pub.version == 7  # a number is never reused: it never goes back
