"""Retry-After from the work ahead (issues 37, 46): the estimator on a fake clock (the queue draining at the
measured decode rate, booked places), the scheduler's QueueFull carrying it, and a real server under a
saturating burst whose refused clients wait exactly Retry-After: the values grow with the queue and
most retries are admitted."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dllm.sampling import SamplingParams
from server.engine.retry_after import Forecast, RetryAfter, Work
from server.engine.scheduler import KVBudget, QueueFull, Request, Scheduler
from server.engine.sequence import ServerSequence


def measured(rate_per_seq: float, now: float = 10.0) -> RetryAfter:
    """An estimator that saw steps decoding `rate_per_seq` tokens per second per sequence."""
    est = RetryAfter()
    for i in range(20):
        est.stepped(4, int(4 * rate_per_seq * 0.1), now=now - 2.0 + 0.1 * i)
    return est


def test_nothing_measured_yet_is_one_second_per_place():
    est = RetryAfter()
    fc = est.forecast([Work(10, 20, 0)], [Work(10, 20, 0)], 0, None, num_slots=1, now=100.0)
    assert [est.estimate(1, 0, fc, now=100.0) for _ in range(3)] == [1, 2, 3]  # each refusal books its place
    assert est.estimate(1, 0, fc, now=103.5) == 1  # the three booked places were due by now: forgotten


def test_the_wait_is_the_work_ahead_not_the_count():
    est = measured(20.0)  # 20 tokens/s per sequence
    assert est.rate(now=10.0) == pytest.approx(20.0)
    running, waiting = [Work(100, 110, 0)] * 4, [Work(100, 110, 0)] * 2  # 5 s of work left each
    fc = est.forecast(running, waiting, 0, None, num_slots=4, now=10.0)
    assert fc.times[:4] == pytest.approx([5.0] * 4)  # 4 end at 5 s: the 2 waiting + 2 more are admitted
    assert fc.times[4] == pytest.approx(10.0)  # the next slot frees 5 s later
    waits = [est.estimate(1, 0, fc, now=10.0) for _ in range(5)]
    assert waits == [6, 6, 6, 6, 11]  # 5 s (+10 %), the fifth refusal behind four booked places: 10 s
    short = measured(20.0)
    fc = short.forecast([Work(10, 20, 0)] * 4, [Work(10, 20, 0)] * 2, 0, None, num_slots=4, now=10.0)
    assert short.estimate(1, 0, fc, now=10.0) == 1  # the same sequences with a tenth of the work: 0.5 s
    long = measured(20.0)
    fc = long.forecast([Work(380, 390, 0)] * 4, [Work(384, 390, 0)] * 10, 0, None, num_slots=4, now=10.0)
    assert long.estimate(1, 0, fc, now=10.0) == 21  # 384-token sequences: 19 s, not "1"


def test_pages_and_the_token_bound():
    est = measured(10.0)
    # 2 free slots but pages for one: the second waiting sequence waits for the running one's 8 pages
    fc = est.forecast([Work(50, 60, 8)], [Work(20, 30, 4), Work(20, 30, 8)], 2, 4, num_slots=3, now=10.0)
    assert fc.times[:2] == pytest.approx([0.0, 5.0])
    assert fc.wait(0, 50, now=10.0) == pytest.approx(5.0)  # 30 + 30 tokens have left by 5 s
    assert Forecast(0.0, (1.0, 2.0), (10, 10), tail_s=0.5, tail_tokens=10).wait(0, 45, now=0.0) == pytest.approx(3.5)
    assert Forecast(0.0, (1.0,), (10,), tail_s=0.5).wait(1, 0, now=0.6) == pytest.approx(0.4)  # made 0.6 s ago


def test_a_sequence_is_expected_to_generate_what_recent_ones_did():
    est = RetryAfter()
    assert est.expected(64) == 64  # nothing finished: all of max_tokens
    for _ in range(4):
        est.finished(16, 64)
    assert est.share() == pytest.approx(0.25)
    assert est.expected(64) == 16 and est.expected(64, 10) == 6 and est.expected(64, 30) == 1
    assert est.expected(64, 64) == 0


def _req(n: int, seq0: int, tokens: int = 10) -> Request:
    seqs = [ServerSequence([1] * (tokens - 5), SamplingParams(max_tokens=5), block_size=4, mask_id=0, seq_id=seq0 + i)
            for i in range(n)]
    return Request("r", seqs, loop=None, events=None)  # type: ignore[arg-type]


def test_scheduler_refusals_carry_the_estimate(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("server.engine.scheduler.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("server.engine.retry_after.time.monotonic", lambda: clock[0])
    sched = Scheduler(max_queue=4, kv=KVBudget(2))  # 2 slots
    for i in range(10):  # 2 running sequences decode 1 token per second each
        sched.retry.stepped(2, 2, now=clock[0] - 10 + i)
    sched.enqueue(_req(2, 0))
    sched.schedule(paused=False, version=0, now=clock[0])  # 2 running, 5 tokens left each: they end in 5 s
    sched.enqueue(_req(4, 20))  # max_queue=4: 4 waiting, the queue is full
    with pytest.raises(QueueFull, match="max_queue=4") as first:
        sched.enqueue(_req(2, 30))  # 2 places short: the 2nd waiting leaves when the 2 running end, at 5 s
    with pytest.raises(QueueFull) as second:
        sched.enqueue(_req(2, 40))  # behind the first's 2 booked places: 4 departures, at 10 s
    assert (first.value.retry_after, second.value.retry_after) == (6, 11)


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
