"""Recording and feedback on real servers (issue 19): record ids on every generation route,
POST /v1/feedback (idempotent, 404, 409, 400, tokens), the store's bound under load, the
`sample` fraction, store failures that never fail a request, and -- with real `dlrl serve`
processes -- two servers sharing one store and feedback that survives a restart."""

from __future__ import annotations

import json
import signal
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from server.api.state import server_state
from store import open_store
from tests.helpers import start_server_process, wait_until

ADMIN, FEEDBACK = "admin-tok", "feedback-tok"
FB = {"Authorization": f"Bearer {FEEDBACK}"}


@pytest.fixture(scope="module")
def rec_server(make_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("fb") / "feedback.db"
    return make_server(max_batch=8, max_model_len=128, admin_token=ADMIN, record="all", store=str(path),
                       feedback_token=FEEDBACK, feedback_labels={"accept": 1.0, "reject": 0.0, "meh": 0.25})


def _feedback(url: str, body: dict, headers: dict | None = FB) -> httpx.Response:
    return httpx.post(url + "/v1/feedback", json=body, headers=headers, timeout=30)


def _sse_chunks(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _stored(srv, record_id: str):
    server_state(srv.app).recorder.flush()
    with open_store(srv.config.store) as st:
        return st.get_record(record_id)


def test_every_route_returns_record_ids_of_exact_samples(rec_server):
    url = rec_server.url
    r = httpx.post(url + "/generate", json={"prompt": ["1+2=", "3+4="], "n": 2, "max_tokens": 6, "seed": 1},
                   timeout=60).json()
    ids = [s["record_id"] for s in r["samples"]]
    assert all(ids) and len(set(ids)) == 4
    rec = _stored(rec_server, ids[2])
    sample = r["samples"][2]
    assert (rec.prompt, rec.prompt_ids, rec.completion_ids, rec.text, rec.version) == (
        "3+4=", sample["prompt_ids"], sample["completion_ids"], sample["text"], sample["version"])
    assert rec.trace["logprobs"] == sample["trace"]["logprobs"] and rec.trace["steps"] == sample["trace"]["steps"]
    assert rec.sampling["max_tokens"] == 6 and rec.sampling["seed"] == 1
    assert rec.server == rec_server.url

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    comp = client.completions.create(model=rec_server.engine.model_name, prompt=["5+6=", "7+8="], max_tokens=4)
    chat = client.chat.completions.create(model=rec_server.engine.model_name, max_tokens=4, n=2,
                                          messages=[{"role": "user", "content": "9+1="}])
    openai_ids = [c.model_extra["record_id"] for c in comp.choices + chat.choices]
    assert all(openai_ids) and len(set(openai_ids)) == 4
    assert _stored(rec_server, openai_ids[1]).prompt == "7+8="
    assert _stored(rec_server, openai_ids[2]).prompt is None  # chat: the exact ids are in prompt_ids

    for path, body in (("/v1/completions", {"prompt": "2+2=", "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "2+2="}], "max_tokens": 4})):
        resp = httpx.post(url + path, json={**body, "stream": True, "n": 2}, timeout=60)
        finals = [c["choices"][0] for c in _sse_chunks(resp) if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 2 and all(f["record_id"] for f in finals), resp.text
        others = [c["choices"][0] for c in _sse_chunks(resp) if c["choices"] and not c["choices"][0]["finish_reason"]]
        assert all(o.get("record_id") is None for o in others)
        rec = _stored(rec_server, finals[0]["record_id"])
        assert rec is not None and rec.finish_reason == finals[0]["finish_reason"]


def test_feedback_idempotent_conflict_unknown_and_labels(rec_server):
    url = rec_server.url
    ids = [s["record_id"] for s in httpx.post(url + "/generate", json={"prompt": "1+1=", "n": 3, "max_tokens": 4},
                                                timeout=60).json()["samples"]]
    first = _feedback(url, {"id": ids[0], "reward": 0.5})
    assert first.status_code == 200 and first.json() == {"id": ids[0], "reward": 0.5, "duplicate": False}
    again = _feedback(url, {"id": ids[0], "reward": 0.5})
    assert again.status_code == 200 and again.json()["duplicate"] is True
    conflict = _feedback(url, {"id": ids[0], "reward": 1.0})
    assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "reward"
    unknown = _feedback(url, {"id": "rec-000000000000000000000000", "reward": 1.0})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "id"
    label = _feedback(url, {"id": ids[1], "label": "meh"})
    assert label.status_code == 200 and label.json()["reward"] == 0.25
    assert _feedback(url, {"id": ids[1], "reward": 0.25}).json()["duplicate"] is True  # same reward: duplicate
    for body, param in (({"id": ids[2], "label": "great"}, "label"), ({"id": ids[2]}, "reward"),
                        ({"id": ids[2], "reward": 1, "label": "accept"}, "reward"), ({"id": ids[2], "reward": "x"},
                                                                                     "reward"),
                        ({"id": "no spaces", "reward": 1}, "id"), ({"id": ids[2], "reward": 1, "extra": 1}, "extra"),
                        ({"id": ids[2], "reward": 1e300}, "reward")):
        bad = _feedback(url, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (body, bad.text)
    with open_store(rec_server.config.store) as st:
        got = {lab.record.id: (lab.reward, lab.label) for lab in st.labeled(limit=10_000)}
    assert got[ids[0]] == (0.5, None) and got[ids[1]] == (0.25, "meh") and ids[2] not in got
    metrics = httpx.get(url + "/metrics").text
    assert "dlrl_feedback_total" in metrics and "dlrl_records_total" in metrics
    assert "dlrl_served_version 0.0" in metrics and "dlrl_store_up 1.0" in metrics
    assert "dlrl_store_errors_total{" not in metrics and "dlrl_records_dropped_total{" not in metrics


def test_feedback_token_boundary(rec_server, server):
    url = rec_server.url
    rid = httpx.post(url + "/generate", json={"prompt": "1+1=", "max_tokens": 2}, timeout=60).json()[
        "samples"][0]["record_id"]
    body = {"id": rid, "reward": 1.0}
    assert _feedback(url, body, headers=None).status_code == 401
    assert _feedback(url, body, headers={"Authorization": "Bearer wrong"}).status_code == 403
    admin = _feedback(url, body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert admin.status_code == 403 and "feedback token" in admin.json()["error"]["message"]
    # the feedback token opens nothing else
    assert httpx.post(url + "/admin/pause", headers=FB, timeout=10).status_code == 403
    assert httpx.get(url + "/weights/kept", headers=FB, timeout=10).status_code == 403
    assert httpx.post(url + "/weights/rollback", json={"version": 0}, headers=FB, timeout=10).status_code == 403
    op = httpx.get(url + "/openapi.json").json()["paths"]["/v1/feedback"]["post"]
    assert op["security"] == [{"feedbackAuth": []}]
    assert {"200", "400", "401", "403", "404", "409", "413", "503"} <= set(op["responses"])
    schema = httpx.get(url + "/openapi.json").json()["components"]["schemas"]["FeedbackRequest"]
    assert [s for s in schema["properties"]["label"]["anyOf"] if "enum" in s][0]["enum"] == ["accept", "meh", "reject"]
    # a server without a feedback token: the route is disabled, never open
    disabled = _feedback(server.url, body)
    assert disabled.status_code == 403 and "disabled" in disabled.json()["error"]["message"]


@pytest.mark.parametrize("override,named", [
    ("server.feedback_labels={accept: true}", "server.feedback_labels.accept"),
    ("server.feedback_labels={accept: .inf}", "server.feedback_labels.accept"),
    ("server.feedback_labels={'': 1}", "server.feedback_labels"),
    ("server.record=some", "server.record"),
    ("server.record_fraction=2", "server.record_fraction"),
    ("server.keep_versions=65", "server.keep_versions"),
    ("server.feedback_token=admin-tok", "server.feedback_token"),
])
def test_alignment_keys_refused_with_the_key_named(override, named):
    from dlrl_config import ConfigError
    from server.config import load_server_config

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_server_config(None, [override, "server.admin_token=admin-tok"])


def _metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith(name))


def test_store_failure_never_fails_a_request(rec_server):
    """A failing store: requests answer at once without ids; a transient cause (full disk) keeps
    the records queued and writes them when the store returns, any other cause drops them."""
    url, recorder = rec_server.url, server_state(rec_server.app).recorder
    real = recorder.store.add_records
    written_before = _metric(url, "dlrl_records_total")

    def full(records):
        raise sqlite3.OperationalError("database or disk is full")

    recorder.store.add_records = full
    try:
        for _ in range(2):
            r = httpx.post(url + "/generate", json={"prompt": "1+1=", "n": 3, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200 and [s["record_id"] for s in r.json()["samples"]] == [None] * 3
        assert _metric(url, 'dlrl_store_errors_total{cause="disk_full",op="record"}') >= 1
        assert _metric(url, "dlrl_store_up") == 0 and _metric(url, "dlrl_record_queue") == 6
        assert _metric(url, "dlrl_record_ids_withheld_total") == 6
    finally:
        recorder.store.add_records = real
    recorder.flush()
    assert _metric(url, "dlrl_records_total") == written_before + 6 and _metric(url, "dlrl_store_up") == 1

    def broken(records):
        raise TypeError("cannot store this (injected)")

    recorder.store.add_records = broken
    try:
        r = httpx.post(url + "/generate", json={"prompt": "1+1=", "n": 3, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and [s["record_id"] for s in r.json()["samples"]] == [None] * 3
        wait_until(lambda: _metric(url, 'dlrl_records_dropped_total{reason="error"}') == 3, 10, "drops counted")
    finally:
        recorder.store.add_records = real
    ok = httpx.post(url + "/generate", json={"prompt": "1+1=", "max_tokens": 2}, timeout=60).json()
    assert ok["samples"][0]["record_id"] and _metric(url, "dlrl_record_queue") == 0


def test_sampled_fraction_and_bound_under_load(make_server, tmp_path):
    srv = make_server(max_batch=32, max_queue=512, max_model_len=64, record="sample", record_fraction=0.3,
                      store=str(tmp_path / "fb.db"), store_max_records=40)

    def burst(k: int) -> list:
        r = httpx.post(srv.url + "/generate", json={"prompt": f"{k}+1=", "n": 40, "max_tokens": 1}, timeout=120)
        assert r.status_code == 200
        return [s["record_id"] for s in r.json()["samples"]]

    with ThreadPoolExecutor(4) as pool:
        ids = [i for batch in pool.map(burst, range(10)) for i in batch]
    num_recorded = sum(i is not None for i in ids)
    assert 400 * 0.3 - 40 <= num_recorded <= 400 * 0.3 + 40, num_recorded  # binomial(400, 0.3): sd 9.2
    server_state(srv.app).recorder.flush()
    with open_store(srv.config.store) as st:
        assert st.stats()["num_records"] == 40  # the newest 40 of ~120 written
    assert f"dlrl_records_total {float(num_recorded)}" in httpx.get(srv.url + "/metrics").text


@pytest.mark.slow
def test_two_processes_share_a_store_and_feedback_survives_restart(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DLRL_FEEDBACK_TOKEN", FEEDBACK)
    store = str(tmp_path / "shared.db")
    args = ("server.record=all", f"server.store={store}", "server.max_batch=8")
    with ThreadPoolExecutor(2) as pool:  # start both at once (each start is mostly imports)
        futures = [pool.submit(start_server_process, tiny_model_dir, ADMIN, tmp_path, *args) for _ in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < 2:
        for srv in started:
            srv.kill()
        futures[0].result(), futures[1].result()  # raises the start error
    a, b = started
    try:
        def gen(url: str) -> list[str]:
            r = httpx.post(url + "/generate", json={"prompt": "1+2=", "n": 4, "max_tokens": 4}, timeout=60)
            return [s["record_id"] for s in r.json()["samples"]]

        with ThreadPoolExecutor(4) as pool:  # both processes write to the store at once
            ids = [i for batch in pool.map(gen, [a.url, b.url] * 4) for i in batch]
        assert all(ids) and len(set(ids)) == 32
        from_b = gen(b.url)
        assert _feedback(a.url, {"id": from_b[0], "reward": 1.0}).json()["duplicate"] is False  # b's record, via a
        assert _feedback(b.url, {"id": ids[0], "label": "reject"}).status_code == 200
        a.kill(signal.SIGTERM)
        assert a.proc.returncode == 0
        first_a = a.url
        a = start_server_process(tiny_model_dir, ADMIN, tmp_path, *args)   # restarted on the same store
        assert _feedback(a.url, {"id": from_b[0], "reward": 1.0}).json()["duplicate"] is True
        assert _feedback(a.url, {"id": from_b[0], "reward": 0.0}).status_code == 409
        assert _feedback(a.url, {"id": ids[1], "reward": 0.5}).json()["duplicate"] is False  # recorded before
    finally:
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)
    with open_store(store) as st:
        labeled = {lab.record.id: lab.reward for lab in st.labeled()}
        assert labeled == {from_b[0]: 1.0, ids[0]: 0.0, ids[1]: 0.5}
        assert st.stats()["num_records"] == 36
        assert {r.server for r in st.prompts(limit=100)} == {first_a, b.url}
