"""OpenAI-compatible endpoints on a real server, through the official `openai` client and raw SSE."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]


def test_completion(client, server):
    resp = client.completions.create(model=server.engine.model_name, prompt="12+3=", max_tokens=8, n=2, seed=4,
                                     logprobs=1)
    assert resp.object == "text_completion" and len(resp.choices) == 2
    for c in resp.choices:
        assert c.finish_reason in ("stop", "length")
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) >= 1
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)


def test_completion_dllm_extras_and_trace(client, server):
    resp = client.completions.create(model=server.engine.model_name, prompt=[[6, 15, 7, 19]], max_tokens=6, seed=0,
                                     extra_body={"strategy": "static", "steps": 2, "return_trace": True,
                                                 "ignore_eos": True})
    choice = resp.choices[0].model_dump()
    assert len(choice["completion_ids"]) == 6 and choice["version"] == 0
    steps = choice["trace"]["steps"]
    assert len(steps) == 6 and set(steps) <= {1, 2}  # static with 2 steps per block


def test_chat_completion_uses_chat_template(client, server):
    resp = client.chat.completions.create(model=server.engine.model_name, max_tokens=8, seed=1,
                                          messages=[{"role": "system", "content": "add"},
                                                    {"role": "user", "content": "2+2"}])
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant" and isinstance(resp.choices[0].message.content, str)
    tok = server.engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "system", "content": "add"}, {"role": "user", "content": "2+2"}],
                                     tokenize=False, add_generation_prompt=True)
    assert resp.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))


def test_completion_stream_matches_non_stream(client, server):
    kwargs = dict(model=server.engine.model_name, prompt="7+8=", max_tokens=13, seed=9,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    deltas = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(deltas) >= 3  # one per committed block, not one blob
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 13


def test_chat_stream(client, server):
    stream = client.chat.completions.create(model=server.engine.model_name, max_tokens=9, seed=2, n=2, stream=True,
                                            messages=[{"role": "user", "content": "hi"}])
    texts, roles, finishes = {0: "", 1: ""}, set(), []
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles.add(c.delta.role)
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert "assistant" in roles and len(finishes) == 2 and all(texts.values())


def test_raw_sse_format(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "1", "max_tokens": 8, "stream": True, "seed": 0}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert {"id", "object", "created", "model", "choices"} <= set(first)


def test_openai_errors_are_4xx_with_param(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.engine.model_name, prompt="1", max_tokens=10**9)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="1", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.engine.model_name, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
