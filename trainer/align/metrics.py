"""Prometheus metrics of the `dlrl align` controller (a private registry, served on `align.metrics_port`).

    m = AlignMetrics()
    m.serve("127.0.0.1", 9400)            # GET http://127.0.0.1:9400/metrics
    m.replica_version.labels(replica=url).set(7)
    m.gate.labels(result="fail").inc()
    m.feedback_to_serving.observe(184.0)

Names: dlrl_align_trainer_version, dlrl_align_serving_version, dlrl_align_candidate_version
(0 when none), dlrl_align_replica_version{replica} (what each serving replica serves, -1 when
down), dlrl_align_replica_target_version{replica} (what it should serve: the candidate on a canary),
dlrl_align_gate_total{result}, dlrl_align_gate_check{check} (1 passed / 0 failed, last gate),
dlrl_align_candidate_accuracy, dlrl_align_candidate_kl, dlrl_align_serving_accuracy,
dlrl_align_promotions_total, dlrl_align_rollbacks_total{kind=auto|manual},
dlrl_align_feedback_records_total{outcome=received|used|stale|invalid|overflow},
dlrl_align_feedback_records_per_second (arrivals over the last minute),
dlrl_align_feedback_to_serving_seconds (histogram: from a user's feedback to a serving version
trained on it), dlrl_align_steps_total, dlrl_align_candidates_total{outcome=passed_gate|gated_out|canary|promoted|
superseded|rolled_back} (counted from the registry events, `CountedStore`), dlrl_align_promotion_paused.
Every labelled counter exists at zero for its known label values from the start.
The training steps' own metrics (dlrl_train_*: step time by phase, reward, KL, staleness) are
served on the same port (trainer.monitor.train_metrics).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainer.monitor.endpoint import MetricsEndpoint  # also: no `*_created` series, process-wide

if TYPE_CHECKING:
    from store import FeedbackStore

_LATENCY_BUCKETS = (10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 43200, 86400)


# registry event kind -> dlrl_align_candidates_total outcome
OUTCOMES = {"gate_passed": "passed_gate", "gate_failed": "gated_out", "canary": "canary", "promoted": "promoted",
            "superseded": "superseded", "rollback": "rolled_back"}


GATE_RESULTS, ROLLBACK_KINDS = ("pass", "fail"), ("auto", "manual")
FEEDBACK_OUTCOMES = ("received", "used", "stale", "invalid", "overflow")  # trainer.align.data counts


class CountedStore:
    """The registry as the controller writes it, counting candidate outcomes from the events it logs
    (everything else goes straight to the store)."""

    def __init__(self, store: FeedbackStore, metrics: AlignMetrics) -> None:
        self._store, self._metrics = store, metrics

    def log_event(self, kind: str, version: int, replica: str | None = None, detail: dict | None = None) -> None:
        self._store.log_event(kind, version, replica, detail)
        detail = detail or {}
        if kind in OUTCOMES and not detail.get("initial") and not (kind == "rollback" and detail.get("kind") != "auto"):
            self._metrics.candidates.labels(outcome=OUTCOMES[kind]).inc()

    def __getattr__(self, name: str) -> Any:  # the store's other methods, unchanged
        return getattr(self._store, name)


class AlignMetrics(MetricsEndpoint):
    port_key = "align.metrics_port"

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.trainer_version = Gauge("dlrl_align_trainer_version", "policy version on the rollout servers",
                                     registry=r)
        self.serving_version = Gauge("dlrl_align_serving_version", "last fully promoted version", registry=r)
        self.candidate_version = Gauge("dlrl_align_candidate_version", "version being promoted (0: none)",
                                       registry=r)
        self.replica_version = Gauge("dlrl_align_replica_version", "version a serving replica serves (-1: down)",
                                     ["replica"], registry=r)
        self.replica_target = Gauge("dlrl_align_replica_target_version", "version a serving replica should serve",
                                    ["replica"], registry=r)
        self.gate = Counter("dlrl_align_gate", "gate decisions", ["result"], registry=r)
        self.gate_check = Gauge("dlrl_align_gate_check", "last gate: 1 passed, 0 failed", ["check"], registry=r)
        self.candidate_accuracy = Gauge("dlrl_align_candidate_accuracy", "held-out accuracy of the last candidate",
                                        registry=r)
        self.candidate_kl = Gauge("dlrl_align_candidate_kl", "KL of the last candidate to the serving version",
                                  registry=r)
        self.serving_accuracy = Gauge("dlrl_align_serving_accuracy", "held-out accuracy of the serving version",
                                      registry=r)
        self.promotions = Counter("dlrl_align_promotions", "versions promoted to every replica", registry=r)
        self.rollbacks = Counter("dlrl_align_rollbacks", "rollbacks of serving replicas", ["kind"], registry=r)
        self.feedback = Counter("dlrl_align_feedback_records", "feedback records by outcome", ["outcome"],
                                registry=r)
        Gauge("dlrl_align_feedback_records_per_second", "feedback records arriving per second (last minute)",
              registry=r).set_function(self.feedback_rate)
        self.feedback_to_serving = Histogram("dlrl_align_feedback_to_serving_seconds",
                                             "from a user's feedback to a serving version trained on it",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.steps = Counter("dlrl_align_steps", "training steps", registry=r)
        self.candidates = Counter("dlrl_align_candidates", "candidates by what became of them", ["outcome"],
                                  registry=r)
        for counter, label, values in ((self.candidates, "outcome", sorted(set(OUTCOMES.values()))),
                                       (self.gate, "result", GATE_RESULTS), (self.rollbacks, "kind", ROLLBACK_KINDS),
                                       (self.feedback, "outcome", FEEDBACK_OUTCOMES)):
            for v in values:  # every series at zero from the start: increase() sees the first event
                counter.labels(**{label: v})
        self.promotion_paused = Gauge("dlrl_align_promotion_paused", "1 while promotion is paused (console)",
                                      registry=r)
        self._arrivals: deque[tuple[float, int]] = deque()
        self._server = None

    def count_feedback(self, counts_delta: dict[str, int]) -> None:
        for outcome, n in counts_delta.items():
            if n > 0:
                self.feedback.labels(outcome=outcome).inc(n)
        if counts_delta.get("received"):
            self._arrivals.append((time.monotonic(), counts_delta["received"]))

    def feedback_rate(self, window_s: float = 60.0) -> float:
        now = time.monotonic()
        while self._arrivals and self._arrivals[0][0] < now - window_s:
            self._arrivals.popleft()
        return sum(n for _, n in self._arrivals) / window_s
