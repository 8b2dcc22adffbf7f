"""`logit_bias` through HTTP (issue 47): OpenAI's shape {"<token id>": bias} on /v1/completions,
/v1/chat/completions and /generate; -100 bans a token, +100 forces it; the trace records the bias and the
trainer's replay of a biased sample reproduces the sampler's log-probabilities (SDAR and LLaDA); hostile
values are a 400 naming `logit_bias`; the engine-core channel carries the bias both ways.

    .venv/bin/python -m pytest -q tests/server/test_server_logit_bias.py
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from dllm.embedded.full_folders import build_llada_folder
from dllm.full.replay import build_full_rows, full_replay_hidden
from dllm.logit_bias import MAX_ENTRIES
from dllm.replay import build_rows, dense_row_bias, replay_hidden, token_logprobs
from rollout_client.protocol.native import Sample
from tests.conftest import RunningServer, start_server

CHAT = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}
PATHS = {"/v1/completions": {"prompt": "1+1=", "max_tokens": 2}, "/v1/chat/completions": CHAT,
         "/generate": {"prompt": "1+1=", "max_tokens": 2}}


def _generate(srv: RunningServer, bias: dict[str, float] | None, temperature: float = 0.0, n: int = 2,
              max_tokens: int = 8) -> list[Sample]:
    body: dict[str, Any] = {"prompt_ids": [[5, 6, 7]], "n": n, "max_tokens": max_tokens, "temperature": temperature,
                            "seed": 7, "ignore_eos": True, "return_trace": True, "strategy": "static", "steps": 2}
    if bias is not None:
        body["logit_bias"] = bias
    r = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [Sample.model_validate(s) for s in r.json()["samples"]]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bias,says", [
    ({"x": 1}, "keys must be token ids"), ({"5": 101}, "[-100, 100]"), ({"5": -100.5}, "[-100, 100]"),
    ({"5": "NaN"}, "finite number"), ({"999999": 1}, "outside the vocabulary"), ("5", "must be an object"),
    ({str(i): 1 for i in range(MAX_ENTRIES + 1)}, f"at most {MAX_ENTRIES} entries"),
])
def test_hostile_biases_get_a_400_naming_the_field(server: Any, path: str, bias: Any, says: str) -> None:
    r = httpx.post(server.url + path, json={**PATHS[path], "logit_bias": bias}, timeout=60)
    err = r.json().get("error") or {}
    assert r.status_code == 400 and err.get("param") == "logit_bias" and says in err.get("message", ""), r.text
    assert "Value error" not in err["message"]


def test_the_mask_token_and_non_finite_json_are_refused(server: Any) -> None:
    mask = server.engine.backend.mask_token_id
    r = httpx.post(server.url + "/generate", json={**PATHS["/generate"], "logit_bias": {str(mask): 1}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and "mask" in r.text
    raw = b'{"prompt": "1+1=", "max_tokens": 2, "logit_bias": {"5": Infinity}}'
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and "logit_bias" in r.text, r.text


def test_ban_and_force_change_the_completion(server: Any) -> None:
    free = _generate(server, None)
    top = free[0].completion_ids[0]
    banned = _generate(server, {str(top): -100})
    assert all(top not in s.completion_ids for s in banned)
    forced = _generate(server, {"42": 100}, temperature=1.0)
    assert all(s.completion_ids == [42] * 8 for s in forced)
    assert forced[0].trace is not None and forced[0].trace.logit_bias == {42: 100.0}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    text = client.completions.create(model=server.engine.model_name, prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                     logit_bias={"42": 100}, extra_body={"ignore_eos": True}).choices[0].text
    assert text == forced[0].text
    chat = client.chat.completions.create(model=server.engine.model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logit_bias={"42": 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == _generate(server, {"42": 100}, max_tokens=4)[0].text


def test_a_biased_trace_replays_exactly_sdar(server: Any) -> None:
    bias = {"3": 4.0, "17": -2.5, "42": 1.5}
    samples = _generate(server, bias, temperature=1.0, n=3)
    model = server.engine.model
    cfg = model.config
    rows = build_rows(samples, cfg.block_size, cfg.mask_token_id, pad_id=0)
    with torch.no_grad():
        logits = model.lm_head(replay_hidden(model, rows))
        lp = token_logprobs(logits, rows.clean, cfg.mask_token_id, bias=dense_row_bias(rows.bias, cfg.vocab_size))
        unbiased = token_logprobs(logits, rows.clean, cfg.mask_token_id)
    old = rows.gather([s.trace.logprobs for s in samples if s.trace is not None])
    assert (lp - old)[rows.target].abs().max() < 1e-4  # the replay invariant over HTTP, biased
    assert (unbiased - old)[rows.target].abs().max() > 1e-2


@pytest.fixture(scope="module")
def llada(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = str(build_llada_folder(tmp_path_factory.mktemp("bias-llada") / "llada"))
    srv = start_server(folder, build=True, block_size=4, max_batch=4, cache_mode="exact")
    yield srv
    srv.server.should_exit = True
    srv.thread.join(timeout=15)


def test_a_biased_trace_replays_exactly_llada(llada: RunningServer) -> None:
    model = llada.engine.model
    cfg = model.config
    banned = _generate(llada, None)[0].completion_ids[0]
    samples = _generate(llada, {"3": 3.0, "21": 2.0, str(banned): -100}, temperature=1.0, n=3)
    assert all(banned not in s.completion_ids for s in samples)
    rows = build_full_rows(samples, cfg.mask_token_id, 0)
    with torch.no_grad():
        logits = model.lm_head(full_replay_hidden(model, rows))
        lp = token_logprobs(logits, rows.clean, cfg.mask_token_id, bias=dense_row_bias(rows.bias, cfg.vocab_size))
    old = rows.gather([s.trace.logprobs for s in samples if s.trace is not None])
    assert (lp - old)[rows.target].abs().max() < 1e-4


def test_the_engine_core_channel_carries_the_bias() -> None:
    from dllm.sampling import SamplingParams
    from dllm.trace import Trace
    from server.core import messages as m
    from server.core.client import params_of
    from server.core.engine_core import sampling_params

    p = SamplingParams(max_tokens=3, logit_bias={5: -100.0, 9: 2.5})
    sub = m.Submit(1, [m.SeqSpec([1, 2], params_of(p))], False)
    got = m.decode_to_core(m.encode(sub))
    assert isinstance(got, m.Submit) and sampling_params(got.seqs[0].params).logit_bias == {5: -100.0, 9: 2.5}
    t = Trace(prompt_len=2, block_size=4, steps=[1], logprobs=[-0.5], logit_bias={5: -100.0})
    end = m.TraceEnd(t.steps, t.logprobs, t.version, None, [], [], None, None, False, "", logit_bias=t.logit_bias)
    assert msgspec_roundtrip(end).logit_bias == {5: -100.0}


def msgspec_roundtrip(end: Any) -> Any:
    import msgspec

    return msgspec.msgpack.decode(msgspec.msgpack.encode(end), type=type(end))


def test_the_openapi_document_bounds_the_ids(server: Any) -> None:
    """A schema-valid logit_bias is accepted: its keys are the vocabulary's ids (server.api.openapi), not the mask."""
    import re

    from server.api.openapi import ids_below

    for n in (1, 7, 10, 64, 101, 151936):
        pattern = re.compile(ids_below(n))
        assert [i for i in range(n + 1100) if pattern.match(str(i))] == list(range(n)) and not pattern.match("01")
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    prop = doc["components"]["schemas"]["CompletionRequest"]["properties"]["logit_bias"]
    obj = next(s for s in prop["anyOf"] if s.get("type") == "object")
    backend = server.engine.backend
    assert obj["propertyNames"] == {"pattern": ids_below(backend.vocab_size),
                                    "not": {"const": str(backend.mask_token_id)}}
    assert obj["maxProperties"] == MAX_ENTRIES and obj["additionalProperties"]["maximum"] == 100


@pytest.mark.slow
def test_through_dlrl_serve_and_its_engine_core_process(serve_process: Any) -> None:
    """The split server (API process + engine-core process): the bias crosses the channel to the core (which
    checks the ids against the model: a 400 naming logit_bias) and back in the trace."""
    srv = serve_process()
    body = {"prompt_ids": [5, 6, 7], "max_tokens": 4, "temperature": 1.0, "ignore_eos": True, "return_trace": True}
    r = httpx.post(srv.url + "/generate", json={**body, "logit_bias": {"42": 100}}, timeout=120)
    assert r.status_code == 200, r.text
    sample = r.json()["samples"][0]
    assert sample["completion_ids"] == [42] * 4 and sample["trace"]["logit_bias"] == {"42": 100.0}
    r = httpx.post(srv.url + "/generate", json={**body, "logit_bias": {"999999": 1}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
