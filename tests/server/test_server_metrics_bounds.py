"""Server metrics keep bounded state however long the server runs (issue 26, bounded memory):
the forwards-per-second gauge remembers only its 10 s window of forwards, whether or not
anyone scrapes /metrics."""

from __future__ import annotations

from server import metrics as metrics_mod
from server.engine.engine import StepStats
from server.metrics import ServerMetrics


def test_forward_times_stay_within_the_window_without_scrapes(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: now[0])
    m = ServerMetrics()
    for _ in range(5000):  # 5000 forwards, 20 per second, and no scrape in between
        m.observe_step(StepStats(batch_size=2, num_tokens=2, seconds=0.01, num_admitted=0, num_waiting=0))
        now[0] += 0.05
    assert len(m._forward_times) <= 201  # 10 s x 20 per second, not 5000
    assert m.forwards_per_second() == 20.0
