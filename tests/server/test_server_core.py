"""The channel between API processes and the engine core (server.core), in-process and fast.

    .venv/bin/python -m pytest -q tests/server/test_server_core.py

Typed messages only (a pickle, an unknown tag or a wrong field type is refused); a step's outputs of
every sequence go to their API process as ONE message; the metric families of several processes merge
into one exposition (counters add up, each family once).
"""

from __future__ import annotations

import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.api.state import server_state
from server.core import messages as m
from server.core.families import merge, render


def test_messages_are_typed_and_nothing_else_is_read():
    sub = m.Submit(7, [m.SeqSpec([1, 2], m.Params(8, 1.0, 0, 1.0, "dynamic", None, 0.9, 3, [], None, False))], True)
    assert m.decode_to_core(m.encode(sub)) == sub
    out = m.Outputs([m.Update(7, 0, [4, 5])], m.Load(1.0, 2, "running", "tiny", 1, 0, 0, 3, 0))
    assert m.decode_to_api(m.encode(out)) == out
    for bad in (pickle.dumps(sub), m.encode({"rid": 7}), m.encode(["Submit", "seven", []]), b"\xc1"):
        with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
            m.decode_to_core(bad)
    with pytest.raises(msgspec.ValidationError):
        m.decode_to_api(m.encode(sub))  # a message of the other direction


def test_families_of_several_processes_merge_into_one_exposition():
    def fam(name: str, kind: str, *samples: tuple[str, dict, float]) -> m.Family:
        return m.Family(name, kind, "doc", list(samples))

    api0 = [fam("dlrl_requests", "counter", ("dlrl_requests_total", {"status": "200"}, 3.0),
                ("dlrl_requests_created", {"status": "200"}, 50.0)),
            fam("dlrl_store_up", "gauge", ("dlrl_store_up", {}, 1.0))]
    api1 = [fam("dlrl_requests", "counter", ("dlrl_requests_total", {"status": "200"}, 4.0),
                ("dlrl_requests_created", {"status": "200"}, 40.0)),
            fam("dlrl_store_up", "gauge", ("dlrl_store_up", {}, 0.0))]
    core = [fam("dlrl_step_seconds", "histogram", ("dlrl_step_seconds_count", {}, 9.0),
                ("dlrl_step_seconds_sum", {}, 0.5), ("dlrl_step_seconds_bucket", {"le": "+Inf"}, 9.0))]
    text = render(merge([api0, core, api1])).decode()
    got = {f.name: {s.name: s.value for s in f.samples} for f in text_string_to_metric_families(text)}
    assert got["dlrl_requests"]["dlrl_requests_total"] == 7.0  # added up over the API processes
    assert got["dlrl_requests_created"]["dlrl_requests_created"] == 40.0  # the earliest
    assert got["dlrl_store_up"]["dlrl_store_up"] == 0.0  # one failing store: down
    assert got["dlrl_step_seconds"]["dlrl_step_seconds_count"] == 9.0
    assert text.count("# TYPE dlrl_requests_total counter") == 1


def test_a_steps_outputs_for_every_sequence_go_out_as_one_message(server):
    outbox = server_state(server.app).core_thread.core.outbox
    sent: list[tuple[bytes, int]] = []
    real = outbox._send
    lock = threading.Lock()

    def spy(ident: bytes, out: m.Outputs) -> None:
        with lock:
            sent.append((ident, len({(e.rid, e.index) for e in out.events})))
        real(ident, out)

    outbox._send = spy
    steps0 = server.engine.num_steps
    body = {"prompt": "1+2=", "max_tokens": 24, "ignore_eos": True, "strategy": "static", "steps": 1, "stream": True}
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=120),
                                    range(8)))
    finally:
        outbox._send = real
    assert all(r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") for r in answers)
    steps = server.engine.num_steps - steps0
    assert len(sent) <= steps + 8, (len(sent), steps)  # about one message per step, never one per sequence
    assert max(n for _, n in sent) >= 4  # a message carried the sequences of several requests
