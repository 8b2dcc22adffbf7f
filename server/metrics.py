"""Prometheus metrics of one server app (a private CollectorRegistry per app).

    metrics = ServerMetrics(engine)        # registers gauges reading the engine live
    engine.add_step_listener(metrics.observe_step)
    metrics.observe_request("/generate", 200, seconds, prompt_tokens)
    metrics.observe_params(n=2, max_tokens=[64])   # per prompt of an accepted request
    body = metrics.render()                # text exposition format for GET /metrics

Every series carries `model_name` (the served model's name, as vLLM's do), and every labelled
counter exists at zero for its known label values from the start (so `increase()` sees the first
event and no dashboard panel shows "No data").

Names follow vLLM's where the concept is the same (`vllm:` becomes `dlrl_`); every family is
listed in README "Operating dlrl". Latency (per sequence, from its request's arrival):
dlrl_time_to_first_token_seconds (first committed block), dlrl_inter_token_latency_seconds
(per token, between two commits of a sequence; a forward commits several),
dlrl_time_per_output_token_seconds, dlrl_e2e_request_latency_seconds,
dlrl_request_latency_seconds{endpoint} (HTTP). Per request (a sequence: one sample of a prompt), as
vLLM: dlrl_request_success_total{finished_reason} (stop, length, abort, error),
dlrl_request_prompt_tokens, dlrl_request_generation_tokens, dlrl_request_params_max_tokens,
dlrl_request_params_n (per prompt of an accepted request), and the time breakdown
dlrl_request_queue_time_seconds (arrival to admission), dlrl_request_prefill_time_seconds
(admission to the first committed block), dlrl_request_decode_time_seconds (first to last commit),
dlrl_request_inference_time_seconds (admission to the last commit). Load:
dlrl_num_requests_running / dlrl_num_requests_waiting (sequences), dlrl_kv_cache_pages_used /
_total / dlrl_kv_cache_usage_perc, dlrl_kv_cache_refusals_total (engine steps that left a
sequence waiting with a free slot but too few KV pages). Prefix cache (server.prefix_caching, as vLLM's,
in tokens): dlrl_prefix_cache_queries_total (prompt tokens of every admission),
dlrl_prefix_cache_hits_total (those whose K/V a cached page held), dlrl_kv_cache_pages_cached (pages
holding a reusable prompt block, in use or not). Block diffusion: dlrl_forwards_total,
dlrl_forwards_per_second, dlrl_tokens_per_forward, dlrl_batch_size, dlrl_step_seconds,
dlrl_prompt_tokens_total, dlrl_generation_tokens_total. Weights: dlrl_model_info{model_name,
version}, dlrl_served_version, dlrl_weight_updates_total{outcome}, dlrl_weight_update_bytes_total,
dlrl_weight_update_{verify,drain,apply}_seconds, dlrl_weight_update_aborts_total,
dlrl_weight_update_refusals_total{step}, dlrl_rollbacks_total. Feedback:
dlrl_feedback_received_total, dlrl_feedback_rejected_total{status}, dlrl_feedback_total (stored),
dlrl_records_total, dlrl_store_records / dlrl_store_feedback / dlrl_store_bytes (store size).
The store: dlrl_store_errors_total{op,cause} (failed store operations), dlrl_store_up,
dlrl_records_dropped_total{reason} (never written), dlrl_record_ids_withheld_total{reason}
(answered without an id), dlrl_record_write_seconds, dlrl_record_queue (records waiting for the
writer). Connections and auth: dlrl_connections_refused_total{reason} (limit, header_timeout, header_size,
read_timeout: server.api.connections), dlrl_auth_failures_total{what,status} (failed admin/feedback
token checks, 401/403/429: server.api.auth). Also dlrl_paused, dlrl_max_batch_size. (The older duplicates
dlrl_queue_depth, dlrl_running_sequences, dlrl_policy_version and dlrl_aborted_sequences are gone:
read dlrl_num_requests_waiting, dlrl_num_requests_running, dlrl_served_version and
dlrl_request_success_total{finished_reason="abort"}.)
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dllm.trace import FinishReason
from store.types import ERROR_CAUSES

if TYPE_CHECKING:
    from server.core.client import CoreClient
    from server.engine.engine import Engine, StepStats
    from server.engine.sequence import ServerSequence as Sequence
    from store import FeedbackStore

disable_created_metrics()  # no `*_created` series: a gauge of start times per counter/histogram clutters /metrics
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TPF_BUCKETS = (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 16, 32)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_SIZE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)  # vLLM's 1-2-5
_N_BUCKETS = (1, 2, 5, 10, 20, 50, 100)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)
CONTENT_TYPE = CONTENT_TYPE_LATEST
STORE_STATS_TTL_S = 5.0  # the store is read at most this often by scrapes

_FORWARDS_WINDOW_S = 10.0  # dlrl_forwards_per_second counts the forwards of this window

# the known label values of the labelled counters: each series exists at zero from the start
ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
FEEDBACK_STATUSES = ("400", "401", "403", "404", "409", "413", "429", "503")  # server/api/routes_feedback.py
STORE_OPS, STORE_CAUSES = ("record", "feedback"), (*ERROR_CAUSES, "queue_full")  # server/recording/store_health.py
DROP_REASONS, WITHHELD_REASONS = ("queue_full", "refused", "error"), ("timeout", "store_failing")  # recording
CONNECTION_REASONS = ("limit", "header_timeout", "header_size", "read_timeout")  # server/api/connections.py
AUTH_WHATS, AUTH_STATUSES = ("admin", "feedback"), ("401", "403", "429")  # server/api/auth_guard.py
UPDATE_STEPS = ("begin", "commit")  # server/weights/weight_updates.py


class _Dynamic:
    """Families whose label values change (served version) or that read other objects at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        engine = self.m.engine
        yield self.m.request_success()
        if engine is not None:
            info = GaugeMetricFamily("dlrl_model_info", "served model and weight version (value 1)",
                                     labels=["model_name", "version"])
            info.add_metric([str(engine.model_name), str(engine.version)], 1.0)
            yield info
            blocks = engine.scheduler.blocks
            yield CounterMetricFamily("dlrl_prefix_cache_queries", "prompt tokens looked up in the prefix cache "
                                      "(every admission)", value=blocks.num_queried_tokens)
            yield CounterMetricFamily("dlrl_prefix_cache_hits", "prompt tokens whose K/V a cached page held",
                                      value=blocks.num_hit_tokens)
            pages = kv_pages(engine)
            if pages is not None:
                yield GaugeMetricFamily("dlrl_kv_cache_pages_cached", "KV-cache pages holding a reusable prompt "
                                        "block (in use or not)", value=blocks.num_cached_pages)
                used, total = pages
                yield GaugeMetricFamily("dlrl_kv_cache_pages_used", "KV-cache pages held by running sequences",
                                        value=used)
                yield GaugeMetricFamily("dlrl_kv_cache_pages_total", "KV-cache pages of the pool", value=total)
                yield GaugeMetricFamily("dlrl_kv_cache_usage_perc", "KV-cache usage (1 = full)",
                                        value=used / total if total else 0.0)
        stats = self.m.store_stats()
        if stats is not None:
            for key, name, text in (("num_records", "dlrl_store_records", "records in the feedback store"),
                                    ("num_feedback", "dlrl_store_feedback", "feedback rows in the store"),
                                    ("bytes", "dlrl_store_bytes", "size of the store's files")):
                yield GaugeMetricFamily(name, text, value=float(stats.get(key) or 0))


class _ModelLabelled:
    """The registry as scraped: every sample gets the served model's `model_name` label (vLLM's
    series all carry one), unless it has its own (dlrl_model_info)."""

    def __init__(self, registry: CollectorRegistry, model_name: Callable[[], str | None]):
        self.registry, self.model_name = registry, model_name

    def collect(self) -> Iterable[Metric]:
        name = self.model_name()
        for family in self.registry.collect():
            if name is not None:
                family.samples = [s if "model_name" in s.labels else s._replace(labels={**s.labels, "model_name": name})
                                  for s in family.samples]
            yield family


def kv_pages(engine: Engine | CoreClient) -> tuple[int, int] | None:
    """(used, total) pages of the paged KV cache as the scheduler accounts for them, None when the
    runner's cache is unpaged (the one reading of it: /metrics and /health)."""
    total = engine.scheduler.kv.num_pages
    return (total - engine.scheduler.free_pages, total) if total else None  # the block manager's: held by running


# the families the engine core updates (the engine's steps and sequences, the weights); an API process updates
# the rest (HTTP, feedback, the store, connections, auth). With the engine in its own process each side sends
# only its own to the one /metrics (server.core.families).
ENGINE_FAMILIES = frozenset({
    "dlrl_generation_tokens", "dlrl_forwards", "dlrl_tokens_per_forward", "dlrl_batch_size", "dlrl_max_batch_size",
    "dlrl_step_seconds", "dlrl_time_to_first_token_seconds", "dlrl_inter_token_latency_seconds",
    "dlrl_time_per_output_token_seconds", "dlrl_e2e_request_latency_seconds", "dlrl_request_queue_time_seconds",
    "dlrl_request_prefill_time_seconds", "dlrl_request_decode_time_seconds", "dlrl_request_inference_time_seconds",
    "dlrl_request_prompt_tokens", "dlrl_request_generation_tokens", "dlrl_kv_cache_refusals",
    "dlrl_weight_updates", "dlrl_weight_update_bytes", "dlrl_weight_update_verify_seconds",
    "dlrl_weight_update_drain_seconds", "dlrl_weight_update_apply_seconds", "dlrl_weight_update_aborts",
    "dlrl_weight_update_refusals", "dlrl_request_success", "dlrl_model_info", "dlrl_kv_cache_pages_used",
    "dlrl_kv_cache_pages_total", "dlrl_kv_cache_usage_perc", "dlrl_num_requests_waiting", "dlrl_prefix_cache_queries",
    "dlrl_prefix_cache_hits", "dlrl_kv_cache_pages_cached",
    "dlrl_num_requests_running", "dlrl_served_version", "dlrl_paused", "dlrl_forwards_per_second"})


class ServerMetrics:
    def __init__(self, engine: Engine | None = None, model_name: Callable[[], str] | None = None,
                 store: FeedbackStore | None = None) -> None:
        """`engine`: the engine whose steps and state this registry reads (the engine core's); `model_name`:
        where the served name comes from without one (an API process: its engine client); `store`: the
        feedback store whose size is scraped (an API process with server.store)."""
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.engine: Engine | None = None
        self.store = store  # store size gauges (None: no store)
        self._store_stats: tuple[float, dict | None] = (0.0, None)
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
        self.ttft = Histogram("dlrl_time_to_first_token_seconds", "arrival to the first committed block of a "
                              "sequence", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dlrl_inter_token_latency_seconds", "time between two commits of a sequence, per "
                             "token committed", buckets=_TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("dlrl_time_per_output_token_seconds", "first token to last, per later token",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("dlrl_e2e_request_latency_seconds", "arrival to the end of a sequence",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("dlrl_request_queue_time_seconds", "arrival to admission into the batch",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.phase_time = {phase: Histogram(f"dlrl_request_{phase}_time_seconds", text, buckets=_LATENCY_BUCKETS,
                                            registry=r)
                           for phase, text in (("prefill", "admission to the first committed block of a sequence"),
                                               ("decode", "first committed block to the last of a sequence"),
                                               ("inference", "admission to the last committed block of a sequence"))}
        self.request_prompt_tokens = Histogram("dlrl_request_prompt_tokens", "prompt tokens of a finished sequence",
                                               buckets=_SIZE_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("dlrl_request_generation_tokens", "tokens generated by a "
                                                   "finished sequence", buckets=_SIZE_BUCKETS, registry=r)
        self.params_max_tokens = Histogram("dlrl_request_params_max_tokens", "max_tokens of each prompt of an "
                                           "accepted request", buckets=_SIZE_BUCKETS, registry=r)
        self.params_n = Histogram("dlrl_request_params_n", "n (samples) of each prompt of an accepted request",
                                  buckets=_N_BUCKETS, registry=r)
        self._finished: Tally[str] = Tally()  # finish reason -> sequences (aborts: the engine's own count)
        self.kv_refusals = Counter("dlrl_kv_cache_refusals", "engine steps that left a sequence waiting with a "
                                   "free slot but too few free KV-cache pages", registry=r)
        self.records = Counter("dlrl_records", "served samples written to the feedback store", registry=r)
        self.feedback = Counter("dlrl_feedback", "new feedback stored by POST /v1/feedback", registry=r)
        self.feedback_received = Counter("dlrl_feedback_received", "POST /v1/feedback requests", registry=r)
        self.feedback_rejected = Counter("dlrl_feedback_rejected", "POST /v1/feedback answered 4xx/5xx",
                                         ["status"], registry=r)
        self.rollbacks = Counter("dlrl_rollbacks", "rollbacks to a kept weight version", registry=r)
        # feedback store (server/recording/recording.py, server/recording/store_health.py)
        self.store_errors = Counter("dlrl_store_errors", "failed feedback store operations by cause",
                                    ["op", "cause"], registry=r)
        self.store_up = Gauge("dlrl_store_up", "0 while the feedback store is failing", registry=r)
        self.records_dropped = Counter("dlrl_records_dropped", "recorded samples never written to the store",
                                       ["reason"], registry=r)
        self.record_ids_withheld = Counter("dlrl_record_ids_withheld", "samples answered without a record_id "
                                           "because their record was not yet written", ["reason"], registry=r)
        self.record_write_seconds = Histogram("dlrl_record_write_seconds", "one batched record write",
                                              buckets=(0.001, 0.0025, 0.005, *_LATENCY_BUCKETS), registry=r)
        self.updates = Counter("dlrl_weight_updates", "weight updates committed", ["outcome"], registry=r)
        self.update_bytes = Counter("dlrl_weight_update_bytes", "bytes of the applied weight updates", registry=r)
        self.update_seconds = {phase: Histogram(f"dlrl_weight_update_{phase}_seconds", f"weight update {phase} "
                                                "time", buckets=_LATENCY_BUCKETS, registry=r)
                               for phase in ("verify", "drain", "apply")}
        self.update_aborts = Counter("dlrl_weight_update_aborts", "weight updates aborted (sender, lease, "
                                     "failure)", registry=r)
        self.update_refusals = Counter("dlrl_weight_update_refusals", "weight-update calls refused", ["step"],
                                       registry=r)
        for outcome in ("applied", "failed"):
            self.updates.labels(outcome=outcome)
        self.connections_refused = Counter(  # server.api.connections: caps reached, header/read timeouts
            "dlrl_connections_refused", "connections refused or closed by the server's bounds", ["reason"], registry=r)
        self.auth_failures = Counter("dlrl_auth_failures", "failed bearer-token checks (server.api.auth)",
                                     ["what", "status"], registry=r)
        self._zero_labelled()
        self._max_batch = 0
        self._forward_times: deque[float] = deque()
        self._lock = threading.Lock()
        self._seq_times: dict[int, list[float]] = {}  # seq_id -> [first token, last commit, tokens at last commit]
        r.register(_Dynamic(self))
        self._scraped = _ModelLabelled(r, lambda: str(self.engine.model_name) if self.engine is not None
                                       else model_name() if model_name is not None else None)
        if engine is not None:
            self.bind_engine(engine)

    def _zero_labelled(self) -> None:
        """Every labelled counter at zero for each of its known label values."""
        for endpoint in ENDPOINTS:
            self.requests.labels(endpoint=endpoint, status="200")
        for status in FEEDBACK_STATUSES:
            self.feedback_rejected.labels(status=status)
        for op in STORE_OPS:
            for cause in STORE_CAUSES:
                self.store_errors.labels(op=op, cause=cause)
        for reason in DROP_REASONS:
            self.records_dropped.labels(reason=reason)
        for reason in WITHHELD_REASONS:
            self.record_ids_withheld.labels(reason=reason)
        for step in UPDATE_STEPS:
            self.update_refusals.labels(step=step)
        for reason in CONNECTION_REASONS:
            self.connections_refused.labels(reason=reason)
        for what in AUTH_WHATS:
            for status in AUTH_STATUSES:
                self.auth_failures.labels(what=what, status=status)

    def request_success(self) -> CounterMetricFamily:
        """dlrl_request_success_total{finished_reason}: finished sequences by finish reason; aborts are the
        engine's count (a sequence aborted while waiting never reaches a step)."""
        family = CounterMetricFamily("dlrl_request_success", "finished sequences by finish reason",
                                     labels=["finished_reason"])
        for reason in FinishReason:
            n = self.engine.num_aborted if reason is FinishReason.ABORT and self.engine is not None \
                else self._finished[reason.value]
            family.add_metric([reason.value], float(n))
        return family

    def register_record_queue(self, depth: Callable[[], float]) -> None:
        Gauge("dlrl_record_queue", "records waiting for the store writer", registry=self.registry).set_function(depth)

    def bind_engine(self, engine: Engine) -> None:
        r = self.registry
        self.engine = engine
        Gauge("dlrl_num_requests_waiting", "sequences waiting for a slot", registry=r).set_function(
            lambda: engine.num_waiting)
        Gauge("dlrl_num_requests_running", "sequences being decoded", registry=r).set_function(
            lambda: engine.num_running)
        Gauge("dlrl_served_version", "weight version served now (after updates and rollbacks)",
              registry=r).set_function(lambda: engine.version)
        Gauge("dlrl_paused", "1 while admission is paused", registry=r).set_function(
            lambda: float(engine.is_paused))
        Gauge("dlrl_forwards_per_second", "batched forwards per second (last 10 s)", registry=r).set_function(
            self.forwards_per_second)
        engine.add_step_listener(self.observe_step)

    def forwards_per_second(self, window_s: float = _FORWARDS_WINDOW_S) -> float:
        with self._lock:
            self._forget_forwards(time.monotonic() - window_s)
            return len(self._forward_times) / window_s

    def _forget_forwards(self, before: float) -> None:
        while self._forward_times and self._forward_times[0] < before:
            self._forward_times.popleft()

    def observe_step(self, stats: StepStats) -> None:
        """Called from the engine thread after every batched forward (stats: engine.StepStats)."""
        if stats.num_cache_refused:
            self.kv_refusals.inc()
        if stats.batch_size <= 0:
            return
        now = time.monotonic()
        with self._lock:  # only the last window is kept, scraped or not (bounded memory)
            self._forward_times.append(now)
            self._forget_forwards(now - _FORWARDS_WINDOW_S)
        self.forwards.inc()
        self.generation_tokens.inc(stats.num_tokens)
        self.tokens_per_forward.observe(stats.num_tokens / stats.batch_size)
        self.batch_size.observe(stats.batch_size)
        self.step_seconds.observe(stats.seconds)
        if stats.batch_size > self._max_batch:
            self._max_batch = stats.batch_size
            self.max_batch_size.set(stats.batch_size)
        for seq in stats.admitted:
            if seq.arrived_at is not None and seq.admitted_at is not None:
                self.queue_time.observe(max(0.0, seq.admitted_at - seq.arrived_at))
        for seq in stats.seqs:
            self._observe_sequence(seq, now)
        if len(self._seq_times) > len(stats.seqs):  # every running sequence is in every forward: the rest ended
            live = {s.seq_id for s in stats.seqs}
            for seq_id in [k for k in self._seq_times if k not in live]:
                del self._seq_times[seq_id]

    def _observe_sequence(self, seq: Sequence, now: float) -> None:
        arrived = seq.arrived_at
        if arrived is None:
            return
        num = len(seq.completion_ids)
        times = self._seq_times.get(seq.seq_id)
        if times is None and num:
            self.ttft.observe(now - arrived)
            times = self._seq_times[seq.seq_id] = [now, now, num]
        elif times is not None and num > times[2]:
            self.itl.observe((now - times[1]) / (num - times[2]))
            times[1:] = [now, num]
        if seq.is_finished:
            self._observe_finished(seq, now - arrived, times)

    def _observe_finished(self, seq: Sequence, e2e: float, times: list[float] | None) -> None:
        """A sequence's end: latency, size, finish reason and its time breakdown (vLLM's phases)."""
        self.e2e.observe(e2e)
        self._seq_times.pop(seq.seq_id, None)
        if seq.finish_reason != FinishReason.ABORT:  # aborts: the engine's count (request_success)
            self._finished[str(seq.finish_reason)] += 1
        self.request_prompt_tokens.observe(len(seq.prompt_ids))
        self.request_generation_tokens.observe(len(seq.completion_ids))
        if times is not None and times[2] > 1:
            self.tpot.observe((times[1] - times[0]) / (times[2] - 1))
        admitted = seq.admitted_at
        if times is not None and admitted is not None:
            self.phase_time["prefill"].observe(max(0.0, times[0] - admitted))
            self.phase_time["decode"].observe(times[1] - times[0])
            self.phase_time["inference"].observe(max(0.0, times[1] - admitted))

    def observe_request(self, endpoint: str, status: int, seconds: float | None = None,
                        prompt_tokens: int = 0) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if seconds is not None:
            self.latency.labels(endpoint=endpoint).observe(seconds)

    def observe_params(self, n: int, max_tokens: Iterable[int]) -> None:
        """dlrl_request_params_{n,max_tokens}: one observation per prompt of an accepted request."""
        for num in max_tokens:
            self.params_n.observe(n)
            self.params_max_tokens.observe(num)

    def observe_feedback_status(self, status: int) -> None:
        self.feedback_received.inc()
        if status >= 400:
            self.feedback_rejected.labels(status=str(status)).inc()

    def store_stats(self) -> dict[str, Any] | None:  # FeedbackStore.stats(): an untyped dict (store/types.py)
        """The store's size (cached STORE_STATS_TTL_S); None without a store or when it cannot be read."""
        if self.store is None:
            return None
        at, stats = self._store_stats
        if time.monotonic() - at > STORE_STATS_TTL_S:
            try:
                stats = self.store.stats()
            except Exception:  # a busy or broken store must not fail the scrape
                stats = None
            self._store_stats = (time.monotonic(), stats)
        return stats

    def families(self, engine_part: bool | None = None) -> list[Metric]:
        """The families as scraped (model_name labelled): all of them (None), the engine core's (True:
        ENGINE_FAMILIES) or the API process's (False: the rest)."""
        return [f for f in self._scraped.collect() if engine_part is None or (f.name in ENGINE_FAMILIES) == engine_part]

    def render(self) -> bytes:
        return generate_latest(self._scraped)  # a prometheus_client Collector: an object with collect()
