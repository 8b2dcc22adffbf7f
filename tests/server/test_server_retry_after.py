"""Retry-After from the queue (issue 37): the estimator on a fake clock (position / service rate,
booked places), the scheduler's QueueFull
carrying it, and a real server under a saturating burst whose refused clients wait exactly
Retry-After: the values grow with the queue and most retries are admitted."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dllm.sampling import SamplingParams
from server.engine.retry_after import RetryAfter
from server.engine.scheduler import QueueFull, Request, Scheduler
from server.engine.sequence import ServerSequence


def test_nothing_measured_yet_is_one_second_per_place():
    est = RetryAfter()
    assert [est.estimate(1, now=100.0) for _ in range(3)] == [1, 2, 3]  # each refusal books its place
    assert est.estimate(1, now=103.5) == 1  # the three booked places were due by now: forgotten


def test_position_over_the_measured_service_rate():
    est = RetryAfter()
    for i in range(8):
        est.finished(2.0, now=float(i))  # sequences run 2 s each: 4 running finish 2 per second
    assert est.rate(4, now=8.0)[0] == pytest.approx(2.0)
    waits = [est.estimate(1, num_running=4, now=8.0) for _ in range(6)]
    assert waits == [1, 1, 2, 2, 3, 3]  # the k-th refused of a burst: k places / 2 per s, rounded up
    assert est.estimate(5, num_running=4, now=8.0) == 6  # 6 booked + 5 ahead = 11 places: 5.5 s
    assert est.estimate(1, num_running=8, now=8.0) == 3  # 8 running: 4 per s; 11 booked + 1 = 12 places
    assert est.estimate(1, num_running=4, now=20.0) == 1  # every booking was due by now: forgotten
    assert RetryAfter().estimate(0, 40, now=0.0) == 1  # tokens, nothing measured: at least 1


def test_tokens_bound_uses_tokens_admitted_per_second():
    est = RetryAfter()
    for i in range(4):
        est.finished(1.0, 25, now=float(i))  # 2 running, 1 s each: 2 sequences/s of 25 tokens = 50 tokens/s
    assert est.estimate(0, 120, num_running=2, now=4.0) == 3


def _req(n: int, seq0: int, tokens: int = 10) -> Request:
    seqs = [ServerSequence([1] * (tokens - 5), SamplingParams(max_tokens=5), block_size=4, mask_id=0, seq_id=seq0 + i)
            for i in range(n)]
    return Request("r", seqs, loop=None, events=None)  # type: ignore[arg-type]


def test_scheduler_refusals_carry_the_estimate(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("server.engine.scheduler.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("server.engine.retry_after.time.monotonic", lambda: clock[0])
    sched = Scheduler(max_queue=4)
    sched.enqueue(_req(2, 0))
    sched.schedule(paused=False, version=0, now=clock[0])  # 2 running sequences of 2 s each: 1 per second
    clock[0] += 2.0
    for seq in sched.running:
        seq.finish_reason = "stop"
        sched.finish(seq)
    sched.enqueue(_req(2, 10))
    sched.schedule(paused=False, version=0, now=clock[0])
    sched.enqueue(_req(4, 20))
    with pytest.raises(QueueFull, match="max_queue=4") as first:
        sched.enqueue(_req(2, 30))  # 4 waiting: 2 places short at 1 sequence/s
    with pytest.raises(QueueFull) as second:
        sched.enqueue(_req(2, 40))  # behind the first's 2 booked places
    assert (first.value.retry_after, second.value.retry_after) == (2, 4)


@pytest.fixture(scope="module")
def saturated(make_server):
    return make_server(max_batch=2, max_queue=2, max_model_len=64)


def _burst(url: str, num_clients: int) -> tuple[list[int], list[int], list[bool]]:
    """`num_clients` requests at once; each refused client waits exactly Retry-After and sends it
    again until admitted. -> (final statuses, Retry-After of every 429 in time order, admitted?
    of every request sent after waiting Retry-After)."""
    lock, start = threading.Lock(), threading.Barrier(num_clients)
    refusals: list[tuple[float, int]] = []
    retries: list[bool] = []
    # 48 forwards a sequence (one token a step): a queue of even a few sequences takes seconds to drain
    body = {"prompt": "1+1=", "max_tokens": 48, "ignore_eos": True, "strategy": "static", "steps": 4}

    def client(_: int) -> int:
        start.wait()
        retried = False
        for _attempt in range(40):
            r = httpx.post(url + "/generate", json=body, timeout=120)
            with lock:
                if retried:
                    retries.append(r.status_code == 200)
                if r.status_code == 429:
                    refusals.append((time.monotonic(), int(r.headers["Retry-After"])))
            if r.status_code != 429:
                return r.status_code
            retried = True
            time.sleep(int(r.headers["Retry-After"]))
        return 429

    with ThreadPoolExecutor(num_clients) as pool:
        codes = list(pool.map(client, range(num_clients)))
    return codes, [v for _, v in sorted(refusals)], retries


def test_a_burst_waiting_retry_after_is_mostly_admitted(saturated):
    """16 clients at once against 2 slots and 2 places in the queue, twice: the first burst
    measures the admission rate, the second is told Retry-After from it."""
    _burst(saturated.url, 16)
    codes, values, retries = _burst(saturated.url, 16)
    assert codes == [200] * 16
    first_wave = values[:12]  # the first refusals of the burst, one per client
    assert len(set(first_wave)) > 1 and first_wave[-1] > first_wave[0], values  # grows with the queue
    assert sum(retries) >= 0.5 * len(retries), (sum(retries), len(retries), values)
