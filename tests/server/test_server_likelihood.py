"""Prompt log-likelihoods over HTTP: native /generate (max_tokens 0, prompt_logprobs) and OpenAI completions
(echo + logprobs, through the official `openai` client) and their refusals (lm-eval-harness: test_lm_eval_recipe.py).

    python -m pytest -q tests/server/test_server_likelihood.py
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from dllm.likelihood import elbo_logprobs, sequential_logprobs


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ids(server: Any, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text, add_special_tokens=False)


def test_native_sequential_matches_dllm(server: Any) -> None:
    r = httpx.post(server.url + "/generate", json={"prompt": ["12+7=19", "3+4=7"], "max_tokens": 0,
                                                   "prompt_logprobs": 2}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == server.engine.version and body["usage"]["completion_tokens"] == 0
    for sample, text in zip(body["samples"], ["12+7=19", "3+4=7"]):
        ids = _ids(server, text)
        assert sample["prompt_ids"] == ids and sample["completion_ids"] == [] and sample["likelihood"] == "sequential"
        ref = sequential_logprobs(server.engine.model, [ids], top_k=2)[0]
        assert sample["prompt_logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(sample["prompt_logprobs"][1:], ref.logprobs[1:])) < 1e-4  # type: ignore[operator]
        assert [len(t) for t in sample["prompt_top_logprobs"][1:]] == [2] * (len(ids) - 1)


def test_native_elbo_is_seeded(server: Any) -> None:
    req = {"prompt_ids": [5, 6, 7, 8, 9, 10], "max_tokens": 0, "prompt_logprobs": 0, "likelihood": "elbo",
           "seed": 4}
    a = httpx.post(server.url + "/generate", json=req, timeout=60).json()["samples"][0]
    b = httpx.post(server.url + "/generate", json=req, timeout=60).json()["samples"][0]
    assert a["prompt_logprobs"] == b["prompt_logprobs"] and a["likelihood"] == "elbo"
    ref = elbo_logprobs(server.engine.model, [[5, 6, 7, 8, 9, 10]], server.config.elbo_samples, seed=4)[0]
    assert max(abs(x - y) for x, y in zip(a["prompt_logprobs"][1:], ref.logprobs[1:])) < 1e-4  # type: ignore[operator]


def test_config_default_and_key(make_server: Any) -> None:
    from server.config import ServerConfig

    with pytest.raises(ValueError, match="likelihood"):
        ServerConfig(likelihood="exact")
    with pytest.raises(ValueError, match="elbo_samples"):
        ServerConfig(elbo_samples=0)
    srv = make_server(likelihood="elbo", elbo_samples=3, max_model_len=64)
    try:
        r = httpx.post(srv.url + "/generate", json={"prompt_ids": [5, 6, 7], "max_tokens": 0, "prompt_logprobs": 0},
                       timeout=60).json()["samples"][0]
        assert r["likelihood"] == "elbo" and r["num_forwards"] == 3  # one row per sample
    finally:
        srv.stop()


def test_openai_echo_logprobs(client: openai.OpenAI, server: Any) -> None:
    """What lm-eval's local-completions sends (echo, logprobs=1, max_tokens 0 or 1) and reads."""
    text = "12+7=19"
    ids = _ids(server, text)
    ref = sequential_logprobs(server.engine.model, [ids], top_k=1)[0]
    r = client.completions.create(model=server.engine.model_name, prompt=text, echo=True, logprobs=1, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and lp is not None and lp.token_logprobs is not None
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref.logprobs[1:])) < 1e-4  # type: ignore[operator]
    assert lp.tokens == list(text) and lp.text_offset == list(range(len(text)))
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert all(t[tok] == v or max(t.values()) > v for t, tok, v in zip(lp.top_logprobs[1:], lp.tokens[1:],
                                                                        lp.token_logprobs[1:]))
    gen = client.completions.create(model=server.engine.model_name, prompt=[ids], echo=True, logprobs=1, max_tokens=1,
                                    temperature=0)
    g = gen.choices[0].logprobs
    assert g is not None and g.token_logprobs is not None and len(g.token_logprobs) == len(ids) + 1
    assert g.token_logprobs[:-1] == lp.token_logprobs and gen.usage is not None and gen.usage.completion_tokens == 1
    assert gen.choices[0].text.startswith(text) and g.text_offset[-1] == len(text)


@pytest.mark.parametrize("body,status,field", [
    ({"prompt_ids": [1, 2, 10 ** 6], "max_tokens": 0, "prompt_logprobs": 0}, 400, "prompt_ids"),
    ({"prompt_ids": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt_ids": [1, 2], "max_tokens": 3, "prompt_logprobs": 0}, 400, "max_tokens"),
    ({"prompt_ids": [1, 2], "max_tokens": 0, "prompt_logprobs": 0, "n": 2}, 400, "n"),
    ({"prompt_ids": [1, 2], "max_tokens": 0, "prompt_logprobs": 0, "likelihood": "exact"}, 400, "likelihood"),
    ({"prompt_ids": [1] * 300, "max_tokens": 0, "prompt_logprobs": 0}, 413, "prompt_ids"),
    ({"prompt_ids": [], "max_tokens": 0, "prompt_logprobs": 0}, 400, "prompt_ids"),
])
def test_native_hostile(server: Any, body: dict, status: int, field: str) -> None:
    r = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert field in r.text


def test_native_mask_token_refused(server: Any) -> None:
    mask = server.engine.model.config.mask_token_id
    r = httpx.post(server.url + "/generate", json={"prompt_ids": [1, mask], "max_tokens": 0, "prompt_logprobs": 0})
    assert r.status_code == 400 and "prompt_ids" in r.text


@pytest.mark.parametrize("kwargs,param", [
    ({"echo": True, "logprobs": 1, "max_tokens": 0, "stream": True}, "stream"),
    ({"echo": True, "logprobs": 1, "max_tokens": 0, "n": 2}, "n"),
    ({"echo": True, "max_tokens": 0}, "max_tokens"),
    ({"logprobs": 1, "max_tokens": 0}, "max_tokens"),
    ({"echo": True, "logprobs": 9, "max_tokens": 0}, "logprobs"),
])
def test_openai_hostile(client: openai.OpenAI, server: Any, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.engine.model_name, prompt="1+1=", **kwargs)
    assert param in json.dumps(e.value.body)


# lm-eval-harness through these routes: tests/server/test_lm_eval_recipe.py (the README's recipe)


def test_call_between_steps_runs_on_the_engine_thread_never_while_paused(server: Any) -> None:
    import asyncio
    import threading

    engine = server.engine

    async def scenario() -> None:
        assert await engine.call_between_steps(lambda: threading.current_thread().name) == "dlrl-engine"
        with pytest.raises(ZeroDivisionError):
            await engine.call_between_steps(lambda: 1 / 0)
        await engine.pause()
        try:
            future = engine.call_between_steps(lambda: engine.version)
            await asyncio.sleep(0.3)
            assert not future.done()  # a paused engine (a weight update) runs nothing
        finally:
            await engine.resume()
        assert await asyncio.wait_for(future, 10) == engine.version

    asyncio.run(scenario())
