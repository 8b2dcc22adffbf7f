"""Prometheus metrics of one server app (a private CollectorRegistry per app).

    metrics = ServerMetrics(engine)        # registers gauges reading the engine live
    engine.add_step_listener(metrics.observe_step)
    metrics.observe_request("/generate", 200, seconds, prompt_tokens, completion_tokens)
    body = metrics.render()                # text exposition format for GET /metrics

Names: dlrl_requests_total{endpoint,status}, dlrl_prompt_tokens_total,
dlrl_generation_tokens_total, dlrl_forwards_total, dlrl_tokens_per_forward,
dlrl_batch_size, dlrl_max_batch_size, dlrl_step_seconds, dlrl_request_latency_seconds,
dlrl_queue_depth, dlrl_running_sequences, dlrl_policy_version, dlrl_paused,
dlrl_aborted_sequences; continuous alignment (issue 19): dlrl_served_version (= the policy
version), dlrl_records_total (samples written to the feedback store), dlrl_feedback_total
(new feedback accepted), dlrl_rollbacks_total, dlrl_store_errors_total (records dropped or
not written, feedback the store could not take); dlrl_connections_refused_total{reason}
(limit, header_timeout, read_timeout: server.connections), dlrl_auth_failures_total{what,status}
(failed admin/feedback token checks, 401/403/429: server.auth).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TPF_BUCKETS = (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 16, 32)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, engine: Any | None = None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("dlrl_requests", "HTTP generation requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dlrl_prompt_tokens", "prompt tokens of finished sequences", registry=r)
        self.generation_tokens = Counter("dlrl_generation_tokens", "tokens committed by decoding", registry=r)
        self.forwards = Counter("dlrl_forwards", "batched denoising forwards (engine steps)", registry=r)
        self.tokens_per_forward = Histogram("dlrl_tokens_per_forward", "tokens committed per sequence per forward",
                                            buckets=_TPF_BUCKETS, registry=r)
        self.batch_size = Histogram("dlrl_batch_size", "sequences sharing one forward",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.max_batch_size = Gauge("dlrl_max_batch_size", "largest batch seen since start", registry=r)
        self.step_seconds = Histogram("dlrl_step_seconds", "engine step wall time",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("dlrl_request_latency_seconds", "request latency (arrival to last token)",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.records = Counter("dlrl_records", "served samples written to the feedback store", registry=r)
        self.feedback = Counter("dlrl_feedback", "new feedback accepted by POST /v1/feedback", registry=r)
        self.rollbacks = Counter("dlrl_rollbacks", "rollbacks to a kept weight version", registry=r)
        self.store_errors = Counter("dlrl_store_errors", "feedback store failures (record dropped or not "
                                    "written, feedback not stored)", registry=r)
        self.connections_refused = Counter(  # server.connections: caps reached, header/read timeouts
            "dlrl_connections_refused", "connections refused or closed by the server's bounds", ["reason"], registry=r)
        self.auth_failures = Counter("dlrl_auth_failures", "failed bearer-token checks (server.auth)",
                                     ["what", "status"], registry=r)
        self._max_batch = 0
        if engine is not None:
            self.bind_engine(engine)

    def bind_engine(self, engine: Any) -> None:
        r = self.registry
        Gauge("dlrl_queue_depth", "sequences waiting for a slot", registry=r).set_function(
            lambda: engine.num_waiting)
        Gauge("dlrl_running_sequences", "sequences being decoded", registry=r).set_function(
            lambda: engine.num_running)
        Gauge("dlrl_policy_version", "version of the served weights", registry=r).set_function(
            lambda: engine.version)
        Gauge("dlrl_served_version", "weight version served now (after updates and rollbacks)",
              registry=r).set_function(lambda: engine.version)
        Gauge("dlrl_paused", "1 while admission is paused", registry=r).set_function(
            lambda: float(engine.is_paused))
        Gauge("dlrl_aborted_sequences", "sequences aborted (client gone, pause)", registry=r).set_function(
            lambda: engine.num_aborted)
        engine.add_step_listener(self.observe_step)

    def observe_step(self, stats: Any) -> None:
        """Called from the engine thread after every batched forward (stats: engine.StepStats)."""
        if stats.batch_size <= 0:
            return
        self.forwards.inc()
        self.generation_tokens.inc(stats.num_tokens)
        self.tokens_per_forward.observe(stats.num_tokens / stats.batch_size)
        self.batch_size.observe(stats.batch_size)
        self.step_seconds.observe(stats.seconds)
        if stats.batch_size > self._max_batch:
            self._max_batch = stats.batch_size
            self.max_batch_size.set(stats.batch_size)

    def observe_request(self, endpoint: str, status: int, seconds: float | None = None,
                        prompt_tokens: int = 0) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if seconds is not None:
            self.latency.labels(endpoint=endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
