"""Native POST /generate on a real uvicorn server: samples, traces equal to dllm.decoding.generate."""

from __future__ import annotations

import httpx
import pytest

from dllm.decoding import generate
from dllm.sampling import SamplingParams
from dllm.tokenizer import encode


def post(server, body: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=timeout)


def reference(server, prompts_ids, params):
    """dllm.decoding.generate on the served model (the engine is idle between tests)."""
    engine = server.engine
    return generate(engine.model, prompts_ids, params, tokenizer=engine.tokenizer)


def test_generate_text_prompts_n_samples(server):
    r = post(server, {"prompt": ["1+2=", "33+4="], "n": 3, "max_tokens": 10, "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == 0 and body["model"] == server.engine.model_name
    samples = body["samples"]
    assert [s["index"] for s in samples] == list(range(6))
    assert [s["prompt_index"] for s in samples] == [0, 0, 0, 1, 1, 1]
    tok = server.engine.tokenizer
    for s in samples:
        assert s["prompt_ids"] == encode(tok, ["1+2=", "33+4="][s["prompt_index"]])
        assert 1 <= len(s["completion_ids"]) <= 10
        assert s["finish_reason"] in ("stop", "length")
        assert server.engine.backend.mask_token_id not in s["completion_ids"]
        t = s["trace"]
        assert len(t["steps"]) == len(t["logprobs"]) == len(s["completion_ids"])
        assert t["block_size"] == 4 and t["prompt_len"] == len(s["prompt_ids"]) and t["version"] == 0
        assert all(1 <= step <= 4 for step in t["steps"]) and all(lp <= 0 for lp in t["logprobs"])
    usage = body["usage"]
    assert usage["completion_tokens"] == sum(len(s["completion_ids"]) for s in samples)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("params", [
    dict(temperature=1.0, strategy="dynamic", threshold=0.05),
    dict(temperature=0.7, top_k=20, top_p=0.9, strategy="static", steps=2),
    dict(temperature=1.0, strategy="sequential"),
    dict(temperature=0.0, strategy="dynamic", threshold=0.9),
])
def test_trace_equals_dllm_generate(server, params):
    """Same seed and params: exactly the ids, steps and logprobs of dllm.decoding.generate."""
    prompt = encode(server.engine.tokenizer, "12+34=")
    r = post(server, {"prompt_ids": prompt, "max_tokens": 17, "seed": 123, **params})
    assert r.status_code == 200, r.text
    sample = r.json()["samples"][0]
    ref = reference(server, [prompt], SamplingParams(max_tokens=17, seed=123, **params))[0]
    assert sample["completion_ids"] == ref.completion_ids
    assert sample["text"] == ref.text
    assert sample["finish_reason"] == ref.finish_reason
    assert sample["trace"]["steps"] == ref.trace.steps
    assert sample["trace"]["logprobs"] == ref.trace.logprobs
    assert sample["trace"]["tail_ids"] == list(getattr(ref.trace, "tail_ids", []))


def test_trace_equals_generate_for_a_batch_and_n(server):
    """Several prompts in one request share forwards exactly as in dllm.decoding.generate;
    sample i of each prompt is seeded with seed + i."""
    tok = server.engine.tokenizer
    prompts = [encode(tok, p) for p in ("1+1=", "123+456=", "7*8=", "Q: 9+9? A:")]
    r = post(server, {"prompt_ids": prompts, "n": 2, "max_tokens": 12, "seed": 7, "ignore_eos": True})
    assert r.status_code == 200, r.text
    samples = r.json()["samples"]
    seeded = [SamplingParams(max_tokens=12, seed=7 + i, ignore_eos=True) for _ in prompts for i in range(2)]
    refs = reference(server, [p for p in prompts for _ in range(2)], seeded)
    for s, ref in zip(samples, refs):
        assert s["completion_ids"] == ref.completion_ids and len(ref.completion_ids) == 12
        assert s["trace"]["steps"] == ref.trace.steps
        assert s["trace"]["logprobs"] == pytest.approx(ref.trace.logprobs, abs=1e-5)


def test_same_seed_same_output_and_return_trace_false(server):
    body = {"prompt": "5+5=", "max_tokens": 9, "seed": 3, "temperature": 1.0}
    a, b = post(server, body).json(), post(server, {**body, "return_trace": False}).json()
    assert a["samples"][0]["completion_ids"] == b["samples"][0]["completion_ids"]
    assert b["samples"][0]["trace"] is None


def test_stop_string_cuts_text(server):
    base = {"prompt": "a", "max_tokens": 24, "seed": 11, "ignore_eos": True}
    full = post(server, base).json()["samples"][0]["text"]
    assert len(full) >= 8
    stop = full[5]
    r = post(server, {**base, "ignore_eos": True, "stop": [stop]}).json()["samples"][0]
    assert r["finish_reason"] == "stop"
    assert r["text"] == full[:full.index(stop)]


def test_stop_token_ids_and_default_max_tokens(server):
    r = post(server, {"prompt": "9", "seed": 1, "ignore_eos": True})  # max_tokens: server default (64)
    sample = r.json()["samples"][0]
    assert len(sample["completion_ids"]) == 64 and sample["finish_reason"] == "length"
    stop_id = sample["completion_ids"][10]
    r = post(server, {"prompt": "9", "seed": 1, "stop_token_ids": [stop_id], "max_tokens": 64}).json()
    ids = r["samples"][0]["completion_ids"]
    assert r["samples"][0]["finish_reason"] == "stop" and ids[-1] == stop_id and stop_id not in ids[:-1]
