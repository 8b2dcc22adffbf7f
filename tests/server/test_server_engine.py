"""Engine behaviour through the real server: continuous batching, pause/resume, limits, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

LONG = {"prompt": "1", "max_tokens": 3000, "strategy": "sequential", "ignore_eos": True, "seed": 0}


async def until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def cancel(*tasks) -> None:
    for t in tasks:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await t


@pytest.fixture(scope="module")
def limits_server(make_server):
    """One slot, a queue of one, long sequences allowed, no admin token."""
    return make_server(max_batch=1, max_queue=1, max_model_len=4096)


def metric_values(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}  # every server series has one
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            out[key] = s.value
    return out


def test_concurrent_requests_share_forwards(server):
    engine = server.engine
    bodies = [{"prompt": f"{i}+{i}=", "max_tokens": 24, "ignore_eos": True, "seed": i,
               "strategy": ["static", "dynamic", "sequential"][i % 3], "temperature": [0.0, 0.8, 1.0][i % 3]}
              for i in range(8)]

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(server.url + "/generate", json=b) for b in bodies))

    steps_before = engine.num_steps
    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses)
    per_request = sum(r.json()["samples"][0]["num_forwards"] for r in responses)
    assert engine.max_batch_seen > 1
    assert engine.num_steps - steps_before < per_request  # forwards were shared
    m = metric_values(server.url)
    assert m["dlrl_max_batch_size"] > 1
    assert m["dlrl_requests_total{endpoint=/generate,status=200}"] >= 8
    assert m["dlrl_batch_size_count"] > 0 and m["dlrl_tokens_per_forward_count"] > 0
    assert m["dlrl_generation_tokens_total"] >= 8 * 24
    assert m["dlrl_served_version"] == 0 and m["dlrl_num_requests_waiting"] == 0


@pytest.fixture(scope="module")
def own_server(make_server):
    """This module pauses a server and moves its version: its own, not the session's."""
    from tests.helpers import ADMIN_TOKEN

    return make_server(max_batch=8, max_queue=64, max_model_len=256, admin_token=ADMIN_TOKEN)


def test_pause_waits_for_inflight_queues_new_and_resume(own_server, admin_headers):
    engine, url = own_server.engine, own_server.url
    long = {"prompt": "2", "max_tokens": 200, "strategy": "sequential", "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            first = asyncio.create_task(c.post(url + "/generate", json=long))
            await until(lambda: engine.num_running == 1)
            pause = asyncio.create_task(c.post(url + "/admin/pause", headers=admin_headers))
            await until(lambda: engine.is_paused)
            queued = asyncio.create_task(c.post(url + "/generate", json={"prompt": "3", "max_tokens": 8}))
            await until(lambda: engine.num_waiting == 1)
            status = (await pause).json()
            assert status["is_paused"] and status["num_running"] == 0 and engine.is_drained
            sample = (await first).json()["samples"][0]
            assert sample["finish_reason"] == "length" and len(sample["completion_ids"]) == 200
            assert (await c.get(url + "/ready")).status_code == 503
            await asyncio.sleep(0.2)  # a negative check: nothing may move while paused
            assert not queued.done() and engine.num_waiting == 1
            await engine.apply_update(1, lambda: None)  # a weight update while paused: it stays paused
            assert engine.is_paused
            assert (await c.post(url + "/admin/resume", headers=admin_headers)).json()["is_paused"] is False
            later = (await queued).json()
            assert later["version"] == 1 and later["samples"][0]["trace"]["version"] == 1
            assert (await c.get(url + "/ready")).status_code == 200

    asyncio.run(main())


def test_pause_abort_inflight(server, admin_headers):
    engine, url = server.engine, server.url

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            req = asyncio.create_task(c.post(url + "/generate", json={**LONG, "max_tokens": 250}))
            await until(lambda: engine.num_running == 1)
            r = await c.post(url + "/admin/pause", headers=admin_headers, json={"abort_inflight": True})
            assert r.status_code == 200 and r.json()["num_running"] == 0
            sample = (await req).json()["samples"][0]
            assert sample["finish_reason"] == "abort" and len(sample["completion_ids"]) < 250
            await c.post(url + "/admin/resume", headers=admin_headers)

    asyncio.run(main())
    assert not engine.is_paused


def test_engine_pause_resume_python_api(server):
    """The contract the weight-sync receiver uses: await pause(); touch model; await resume()."""
    engine = server.engine

    async def main():
        await engine.pause()
        assert engine.is_paused and engine.is_drained and engine.model is not None
        await engine.resume()

    asyncio.run(main())
    assert not engine.is_paused
    r = httpx.post(server.url + "/generate", json={"prompt": "1", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


def test_queue_full_is_429(limits_server):
    engine, url = limits_server.engine, limits_server.url

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            running = asyncio.create_task(c.post(url + "/generate", json=LONG))
            await until(lambda: engine.num_running == 1)
            waiting = asyncio.create_task(c.post(url + "/generate", json=LONG))
            await until(lambda: engine.num_waiting == 1)
            r = await c.post(url + "/generate", json={"prompt": "1", "max_tokens": 4})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1  # estimated: test_server_backpressure
            assert r.json()["error"]["type"] == "rate_limit_error"
            r = await c.post(url + "/v1/completions", json={"prompt": "1", "max_tokens": 4, "stream": True})
            assert r.status_code == 429
            await cancel(waiting, running)
        await until(lambda: engine.num_running == 0 and engine.num_waiting == 0)

    asyncio.run(main())


def test_client_disconnect_frees_slot(limits_server):
    engine, url = limits_server.engine, limits_server.url
    aborted = engine.num_aborted

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            task = asyncio.create_task(c.post(url + "/generate", json=LONG))
            await until(lambda: engine.num_running == 1)
            await cancel(task)  # closes the connection mid-request
        await until(lambda: engine.num_running == 0 and engine.scheduler.num_free_slots == 1)

    asyncio.run(main())
    assert engine.num_aborted == aborted + 1
    r = httpx.post(url + "/generate", json={"prompt": "1", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


def test_stream_disconnect_frees_slot(limits_server):
    engine, url = limits_server.engine, limits_server.url
    aborted = engine.num_aborted
    with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    asyncio.run(until(lambda: engine.num_running == 0 and engine.scheduler.num_free_slots == 1))
    assert engine.num_aborted == aborted + 1
