"""The metrics operators read (issue 25), scraped from real processes and parsed with
prometheus_client's own text parser: a `dlrl serve` process (latency histograms, KV-cache pages,
weight-update counts and timings, feedback counts, store size, the served version as a label),
a `dlrl train` run's own /metrics port while it trains, JSON logs with the request id, and
`X-Request-Id` returned to the client. Every metric the README's "Operating dlrl" section and the
Grafana dashboard name is exported by some process (tests/deploy/test_grafana.py checks the queries)."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
ADMIN, FEEDBACK = "scrape-admin", "scrape-feedback"


def families(text: str, model_names: set[str] | None = None) -> dict[str, dict[tuple, float]]:
    """family name -> {(sample name, sorted labels but model_name): value}; every line must parse.
    The model_name labels seen are added to `model_names` (dlrl_model_info's own excepted)."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        samples = out.setdefault(fam.name, {})
        for s in fam.samples:
            labels = dict(s.labels)
            if fam.name != "dlrl_model_info":
                name = labels.pop("model_name", None)
                if model_names is not None:
                    model_names.add(str(name))
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    return fams[family][(sample or family, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """A real `dlrl serve` with recording, feedback, JSON logs; traffic, feedback and one weight push."""
    from tests.helpers import start_server_process

    tmp = tmp_path_factory.mktemp("scrape")
    import os

    os.environ["DLRL_FEEDBACK_TOKEN"] = FEEDBACK
    try:
        srv = start_server_process(tiny_model_dir, ADMIN, tmp, "server.log_format=json", "server.record=all",
                                   f"server.store={tmp / 'fb.db'}", "server.keep_versions=1",
                                   "server.max_model_len=128")
    finally:
        del os.environ["DLRL_FEEDBACK_TOKEN"]
    try:
        yield srv, _traffic(srv.url, tiny_model_dir)
    finally:
        srv.kill()


def _traffic(url: str, model_dir: str) -> dict:
    from dllm.weights import load_pretrained
    from weight_sync import push

    r = httpx.post(url + "/v1/completions", json={"prompt": "12+7=", "max_tokens": 8},
                   headers={"X-Request-Id": "client-42"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42"
    rid = r.json()["choices"][0]["record_id"]
    bad = httpx.get(url + "/health", headers={"X-Request-Id": "no spaces allowed"}, timeout=10)
    assert re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])  # an invalid id is replaced
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "3+4=", "max_tokens": 12, "stream": True},
                      timeout=60) as s:
        assert s.status_code == 200 and s.headers["x-request-id"]
        s.read()
    assert httpx.post(url + "/generate", json={"prompt": "1+1=", "n": 3, "max_tokens": 8}, timeout=60).is_success
    fb = {"Authorization": f"Bearer {FEEDBACK}"}
    assert httpx.post(url + "/v1/feedback", json={"id": rid, "label": "accept"}, headers=fb, timeout=10).is_success
    assert httpx.post(url + "/v1/feedback", json={"id": rid, "label": "nope"}, headers=fb, timeout=10).status_code == 400
    model = load_pretrained(model_dir)
    push([url], model.hf_named_tensors(), 1, transport="http", token=ADMIN)
    stale = httpx.post(url + "/weights/begin", json={"version": 1, "transport": "http", "manifest": {}},
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert 400 <= stale.status_code < 500, stale.text  # version 1 is served already: refused
    return {"record_id": rid}


def test_server_metrics_parse_and_count_what_happened(served):
    srv, _ = served
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    assert "_created" not in text  # prometheus_client's start-time series are off (issue 47)
    fams = families(text)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert value(fams, f"dlrl_{name}", f"dlrl_{name}_count") >= 5, name  # 1 + 1 + 3 sequences
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):  # sequences of 2+ tokens only
        assert value(fams, f"dlrl_{name}", f"dlrl_{name}_count") >= 1, name  # (a sampled one may end at EOS)
    assert value(fams, "dlrl_e2e_request_latency_seconds", "dlrl_e2e_request_latency_seconds_sum") > 0
    assert value(fams, "dlrl_prompt_tokens", "dlrl_prompt_tokens_total") > 0
    assert value(fams, "dlrl_generation_tokens", "dlrl_generation_tokens_total") >= 5  # sampled: EOS may come early
    assert value(fams, "dlrl_forwards", "dlrl_forwards_total") > 0
    assert value(fams, "dlrl_num_requests_running") == 0 and value(fams, "dlrl_num_requests_waiting") == 0
    total = value(fams, "dlrl_kv_cache_pages_total")
    assert total > 0 and value(fams, "dlrl_kv_cache_pages_used") == 0 == value(fams, "dlrl_kv_cache_usage_perc")
    assert value(fams, "dlrl_kv_cache_refusals", "dlrl_kv_cache_refusals_total") == 0
    # prefix caching (on by default): the n=3 request's samples share its prompt's complete block(s)
    queries = value(fams, "dlrl_prefix_cache_queries", "dlrl_prefix_cache_queries_total")
    hits = value(fams, "dlrl_prefix_cache_hits", "dlrl_prefix_cache_hits_total")
    assert queries >= 4 + 4 + 3 * 4 and 2 * 4 <= hits < queries and value(fams, "dlrl_kv_cache_pages_cached") >= 1
    # the served weights: version 1 after the push, as a label of the info family
    [(labels, v)] = [(dict(k[1]), v) for k, v in fams["dlrl_model_info"].items()]
    assert labels["version"] == "1" and labels["model_name"] and v == 1
    assert value(fams, "dlrl_weight_updates", "dlrl_weight_updates_total", outcome="applied") == 1
    assert value(fams, "dlrl_weight_update_bytes", "dlrl_weight_update_bytes_total") > 100_000
    for phase in ("verify", "drain", "apply"):
        assert value(fams, f"dlrl_weight_update_{phase}_seconds", f"dlrl_weight_update_{phase}_seconds_count") == 1
    assert value(fams, "dlrl_weight_update_aborts", "dlrl_weight_update_aborts_total") == 0
    assert value(fams, "dlrl_weight_update_refusals", "dlrl_weight_update_refusals_total", step="begin") == 1
    # feedback: 2 received, 1 rejected (400), 1 stored; 5 samples recorded in the store
    assert value(fams, "dlrl_feedback_received", "dlrl_feedback_received_total") == 2
    assert value(fams, "dlrl_feedback_rejected", "dlrl_feedback_rejected_total", status="400") == 1
    assert value(fams, "dlrl_feedback", "dlrl_feedback_total") == 1
    assert value(fams, "dlrl_store_records") == 5 and value(fams, "dlrl_store_feedback") == 1
    assert value(fams, "dlrl_store_bytes") > 0


def test_vllm_request_metrics_count_the_requests_and_every_series_names_the_model(served):
    """Issue 38: finish reasons, request sizes, the per-request time breakdown, `model_name` on every
    series, labelled counters at zero before their first event, no duplicate series."""
    srv, _ = served
    seen: set[str] = set()
    fams = families(httpx.get(srv.url + "/metrics", timeout=10).text, seen)
    [(info, _)] = list(fams["dlrl_model_info"].items())
    assert seen == {dict(info[1])["model_name"]}  # every sample of every family, one served model
    # the traffic: 3 prompts (n=1 max 8, n=1 max 12 streamed, n=3 max 8) = 5 sequences
    assert value(fams, "dlrl_request_params_n", "dlrl_request_params_n_count") == 3
    assert value(fams, "dlrl_request_params_n", "dlrl_request_params_n_sum") == 5
    assert value(fams, "dlrl_request_params_max_tokens", "dlrl_request_params_max_tokens_sum") == 8 + 12 + 8
    assert value(fams, "dlrl_request_params_max_tokens", "dlrl_request_params_max_tokens_bucket", le="10.0") == 2
    finished = {reason: value(fams, "dlrl_request_success", "dlrl_request_success_total", finished_reason=reason)
                for reason in ("stop", "length", "abort", "error")}
    assert finished["stop"] + finished["length"] == 5 and finished["abort"] == finished["error"] == 0, finished
    assert value(fams, "dlrl_request_prompt_tokens", "dlrl_request_prompt_tokens_count") == 5
    assert value(fams, "dlrl_request_generation_tokens", "dlrl_request_generation_tokens_count") == 5
    generated = value(fams, "dlrl_request_generation_tokens", "dlrl_request_generation_tokens_sum")
    assert 5 <= generated <= value(fams, "dlrl_generation_tokens", "dlrl_generation_tokens_total")  # decoding may
    # commit a block's tokens past EOS or a stop string: counted decoded, cut from the completion
    sums = {}
    for phase in ("queue", "prefill", "decode", "inference"):
        name = f"dlrl_request_{phase}_time_seconds"
        assert value(fams, name, name + "_count") == 5, phase
        sums[phase] = value(fams, name, name + "_sum")
    assert sums["prefill"] > 0 and sums["inference"] >= sums["prefill"] + sums["decode"] - 1e-6, sums
    # labelled counters exist at zero before their first event
    zero = {("dlrl_weight_update_refusals", (("step", "commit"),)), ("dlrl_feedback_rejected", (("status", "404"),)),
            ("dlrl_store_errors", (("cause", "disk_full"), ("op", "record"))),
            ("dlrl_store_errors", (("cause", "unavailable"), ("op", "feedback"))),
            ("dlrl_records_dropped", (("reason", "queue_full"),)), ("dlrl_record_ids_withheld", (("reason", "timeout"),)),
            ("dlrl_connections_refused", (("reason", "limit"),)),
            ("dlrl_auth_failures", (("status", "401"), ("what", "feedback"))),
            ("dlrl_requests", (("endpoint", "/v1/chat/completions"), ("status", "200")))}
    for family, labels in zero:
        assert fams[family][(family + "_total", labels)] == 0, (family, labels)
    for gone in ("dlrl_queue_depth", "dlrl_running_sequences", "dlrl_policy_version", "dlrl_aborted_sequences"):
        assert gone not in fams, gone
    # a stream the client leaves: its sequence counts as an abort
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "prompt": "9+9=", "max_tokens": 100, "ignore_eos": True, "stream": True}) as s:
        next(s.iter_lines())
    wait_until(lambda: value(families(httpx.get(srv.url + "/metrics", timeout=10).text), "dlrl_request_success",
                             "dlrl_request_success_total", finished_reason="abort") == 1, 30, "the abort counted")


def test_json_logs_carry_request_id_version_and_timing(served):
    srv, _ = served
    # every JSON-looking line is one whole event
    events = [json.loads(line) for line in srv.log_path.read_text().splitlines() if line.startswith("{")]
    mine = [e for e in events if e.get("request_id") == "client-42"]
    assert len(mine) == 1, events[-5:]
    e = mine[0]
    assert e["path"] == "/v1/completions" and e["status"] == 200 and e["version"] == 0 and e["duration_s"] > 0
    assert e["logger"] == "dlrl.request" and e["level"] == "info" and e["ts"].endswith("Z")
    assert any(e.get("logger", "").startswith("uvicorn") for e in events)  # uvicorn's lines are JSON too
    assert not [line for line in srv.log_path.read_text().splitlines() if "dlrl.request" in line
                and not line.startswith("{")]


def test_trainer_serves_its_own_metrics_while_it_trains(served, tiny_model_dir, tmp_path):
    from trainer.cli import main

    srv, _ = served
    port = free_port()
    cfg = {"train": {"servers": [srv.url], "model": tiny_model_dir, "output_dir": str(tmp_path / "run"),
                     "num_steps": 3, "prompts_per_step": 2, "group_size": 2, "max_tokens": 6, "eval_every": 0,
                     "reward": "tests.helpers:parity_reward", "admin_token": ADMIN, "start_server": False,
                     "tensorboard": False, "metrics_port": port}}
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg))
    scraped: list[str] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            try:
                scraped.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=scrape, daemon=True)
    t.start()
    try:
        assert main(["--config", str(path)]) == 0
    finally:
        done.set()
        t.join()
    fams = [families(text) for text in scraped]
    last = max(fams, key=lambda f: value(f, "dlrl_train_steps", "dlrl_train_steps_total"))
    assert value(last, "dlrl_train_steps", "dlrl_train_steps_total") >= 2
    assert value(last, "dlrl_train_step_seconds", phase="rollout") > 0
    assert value(last, "dlrl_train_step_seconds", phase="train") > 0
    assert value(last, "dlrl_train_step_duration_seconds", "dlrl_train_step_duration_seconds_count") >= 2
    assert 0 <= value(last, "dlrl_train_reward_mean") <= 1 and value(last, "dlrl_train_version") >= 2
    assert "dlrl_train_staleness" in last and "dlrl_train_kl" in last
