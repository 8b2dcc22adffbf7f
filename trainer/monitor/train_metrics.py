"""Prometheus metrics of a training run (`dlrl train`, and the steps of `dlrl align`).

    m = TrainMetrics()                        # its own registry; or TrainMetrics(align_metrics.registry)
    m.serve("127.0.0.1", 9300)                # GET http://127.0.0.1:9300/metrics (train.metrics_port)
    m.observe(step, metrics)                  # what Run.log logs: the step's metrics dict

Names: dlrl_train_steps_total, dlrl_train_step (last logged), dlrl_train_version,
dlrl_train_step_seconds{phase=rollout|reward|replay|train|sync|eval|step} (the last step's
breakdown), dlrl_train_step_duration_seconds (histogram of whole steps), dlrl_train_reward_mean,
dlrl_train_reward_std, dlrl_train_accuracy (training samples), dlrl_train_eval_accuracy (held-out),
dlrl_train_kl (kl_ref, else approx_kl), dlrl_train_staleness (versions between the oldest rollout
and the policy), dlrl_train_tokens_per_forward, dlrl_train_response_length. Rank 0 serves them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, TypeGuard

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainer.monitor.endpoint import MetricsEndpoint  # also: no `*_created` series, process-wide

PHASES = ("rollout", "reward", "replay", "train", "sync", "eval", "step")
_STEP_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
HISTORY = 2000  # steps kept in memory for the align console
HISTORY_KEYS = ("version", "reward_mean", "eval_accuracy", "serving_accuracy", "serving_version", "feedback_used",
                "feedback_rate", "staleness", "time_step")
# gauge name -> the metric keys it reads (the first one present)
GAUGES = {
    "reward_mean": ("reward_mean",), "reward_std": ("reward_std",), "accuracy": ("accuracy",),
    "eval_accuracy": ("eval_accuracy",), "kl": ("kl_ref", "kl", "approx_kl"), "staleness": ("staleness",),
    "tokens_per_forward": ("tokens_per_forward",), "response_length": ("response_length",),
    "version": ("version",),
}


class TrainMetrics(MetricsEndpoint):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry(auto_describe=True)
        self.steps = Counter("dlrl_train_steps", "training steps logged", registry=r)
        self.step = Gauge("dlrl_train_step", "last logged step", registry=r)
        self.phase = Gauge("dlrl_train_step_seconds", "the last step's time by phase", ["phase"], registry=r)
        for phase in PHASES:
            self.phase.labels(phase=phase)
        self.duration = Histogram("dlrl_train_step_duration_seconds", "wall time of whole steps",
                                  buckets=_STEP_BUCKETS, registry=r)
        self.gauges = {name: Gauge(f"dlrl_train_{name}", f"last logged {name.replace('_', ' ')}", registry=r)
                       for name in GAUGES}
        self._history: deque = deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._server = None

    def history(self) -> list[dict]:
        """The last HISTORY logged steps' HISTORY_KEYS (the align console's charts)."""
        with self._lock:
            return list(self._history)

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        self.step.set(step)
        with self._lock:
            self._history.append({"step": step, "time": time.time(),
                                  **{k: metrics[k] for k in HISTORY_KEYS if _is_number(metrics.get(k))}})
        if "time_step" in metrics or "reward_mean" in metrics:  # a training step (not the step-0 evaluation)
            self.steps.inc()
        for phase in PHASES:
            value = metrics.get(f"time_{phase}")
            if _is_number(value):
                self.phase.labels(phase=phase).set(value)
        if _is_number(metrics.get("time_step")):
            self.duration.observe(metrics["time_step"])
        for name, keys in GAUGES.items():
            value = next((metrics[k] for k in keys if _is_number(metrics.get(k))), None)
            if value is not None:
                self.gauges[name].set(value)

def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
