"""Back-pressure and deadlines (issue 26) on real servers: a KV cache filled by many long requests
(each one completes or gets a 429/503 that says why, never a 500; every page is free afterwards),
the queue's token bound, and request deadlines (a client `timeout`: 408, the server's
`max_request_s`: 503) that abort a waiting or running request and free its cache. Retry-After:
test_server_retry_after.py.

A sequence gets the KV pages of prompt + max_tokens when it is admitted, so a running sequence
cannot run out of cache mid-generation: there is nothing to preempt, and what is tested is
admission (wait for pages, bounded by the queue's token bound and the deadline)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import wait_until

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny model: layers x (k, v) x kv heads x head_dim x float32


@pytest.fixture(scope="module")
def small_cache(make_server):
    # room for 3 sequences of 64 tokens; at most ~5 long requests' tokens may wait
    return make_server(max_batch=8, max_model_len=64, kv_cache_memory=3 * 64 * BYTES_PER_TOKEN,
                       max_queue=64, max_queue_tokens=300)


def _assert_cache_free(srv) -> None:
    sched = srv.engine.scheduler  # its block manager holds every page and slot (cached prompt blocks are free)
    wait_until(lambda: srv.engine.num_running == 0 and srv.engine.num_waiting == 0, 30, "engine idle")
    assert sched.free_pages == srv.engine.backend.kv_plan.num_pages
    assert sched.num_free_slots == 8 and sched.waiting_tokens == 0


def test_long_requests_filling_the_cache_complete_or_get_a_reason(small_cache):
    url = small_cache.url

    def long_request(i: int) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json={"prompt": f"{i}+1=", "max_tokens": 56, "ignore_eos": True,
                                                         "strategy": "static", "steps": 4}, timeout=300)

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(long_request, range(12)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429, 503}, [r.text for r in responses if r.status_code not in (200, 429, 503)]
    assert codes.count(200) >= 3 and codes.count(429) >= 1, codes  # the cache ran full, the token bound refused
    for r in responses:
        if r.status_code == 200:
            assert len(r.json()["choices"][0]["text"]) > 0 and r.json()["usage"]["completion_tokens"] == 56
        else:
            err = r.json()["error"]
            assert "max_queue_tokens" in err["message"] or "deadline" in err["message"], err
            assert int(r.headers["Retry-After"]) >= 1
    _assert_cache_free(small_cache)


@pytest.fixture(scope="module")
def long_cache(make_server):
    # room for 3 sequences of 2048 tokens: requests of 2000 tokens run long enough (2000 forwards) that a
    # deadline of a fraction of a second expires while they run or wait, however fast the box
    return make_server(max_batch=8, max_model_len=2048, kv_cache_memory=3 * 2048 * BYTES_PER_TOKEN, max_queue=64)


LONG = {"max_tokens": 2000, "ignore_eos": True, "strategy": "static", "steps": 4}


def test_deadlines_abort_waiting_and_running_requests_and_free_the_cache(long_cache):
    url = long_cache.url
    with ThreadPoolExecutor(6) as pool:  # 3 fill the cache; the next waits for pages with a short deadline
        slow = [pool.submit(httpx.post, url + "/generate", json={"prompt": "1+1=", **LONG}, timeout=600)
                for _ in range(3)]
        wait_until(lambda: long_cache.engine.num_running == 3, 60, "cache full")
        t0 = time.monotonic()
        waiting = httpx.post(url + "/generate", json={"prompt": "2+2=", **LONG, "timeout": 0.3}, timeout=60)
        assert time.monotonic() - t0 < 10
        assert waiting.status_code == 408 and "waiting for KV cache pages" in waiting.json()["error"]["message"]
        assert all(f.result().status_code == 200 for f in slow)
    running = httpx.post(url + "/generate", json={"prompt": "3+3=", **LONG, "timeout": 0.2}, timeout=60)
    assert running.status_code == 408, running.text  # admitted at once, expires while it runs
    assert "deadline exceeded" in running.json()["error"]["message"]
    streamed = httpx.post(url + "/v1/completions", json={"prompt": "3+3=", **LONG, "timeout": 0.2, "stream": True},
                          timeout=60)  # the 200 went out first: the deadline's 408 is the stream's error event
    errors = [json.loads(line[6:])["error"] for line in streamed.text.splitlines() if '"error"' in line]
    assert errors and errors[0]["code"] == 408 and "deadline exceeded" in errors[0]["message"], streamed.text
    bad = httpx.post(url + "/generate", json={"prompt": "1+1=", "timeout": -1}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
    sched = long_cache.engine.scheduler
    wait_until(lambda: long_cache.engine.num_running == 0 and long_cache.engine.num_waiting == 0, 30, "engine idle")
    assert sched.free_pages == long_cache.engine.backend.kv_plan.num_pages and sched.num_free_slots == 8


def test_server_max_request_s_caps_every_request(make_server):
    srv = make_server(max_batch=1, max_model_len=2048, max_request_s=0.3)
    body = {"prompt": "1+1=", **LONG, "timeout": 3600}
    with ThreadPoolExecutor(3) as pool:  # one runs past the cap, two wait past it
        codes = [r.status_code for r in pool.map(lambda _: httpx.post(srv.url + "/generate", json=body, timeout=60),
                                                  range(3))]
    assert codes == [503, 503, 503], codes
    wait_until(lambda: srv.engine.num_running == 0 and srv.engine.num_waiting == 0, 30, "engine idle")
    assert srv.engine.scheduler.num_free_slots == 1
