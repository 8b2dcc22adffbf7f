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


# --------------------------------------------------------------------------- what real clients send

def test_null_means_default(client, server):
    """The official client sends None as JSON null: every optional field then takes its default."""
    kwargs = dict(model=server.engine.model_name, prompt="4+4=", seed=3,
                  extra_body={"ignore_eos": None, "strategy": None, "steps": None, "return_trace": None})
    nulls = client.completions.create(max_tokens=None, temperature=None, top_p=None, n=None, stop=None,
                                      logprobs=None, echo=None, stream=None, user=None, **kwargs)
    plain = client.completions.create(**kwargs)
    assert nulls.choices[0].text == plain.choices[0].text and len(nulls.choices) == 1
    chat = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}], n=None,
                                          max_tokens=None, max_completion_tokens=None, temperature=None, top_p=None,
                                          stop=None, seed=None, logprobs=None, top_logprobs=None, stream=None)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.choices[0].logprobs is None


def test_assistant_tool_call_turn_with_null_content(client, server):
    messages = [{"role": "system", "content": "calc"}, {"role": "user", "content": [{"type": "text", "text": "2+2"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    resp = client.chat.completions.create(model=server.engine.model_name, messages=messages, max_tokens=4, seed=0)
    tok = server.engine.tokenizer
    rendered = tok.apply_chat_template([{"role": m["role"], "content": c} for m, c in zip(
        messages, ["calc", "2+2", "", "4"])], tokenize=False, add_generation_prompt=True)
    assert resp.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as e:  # a user turn needs content
        client.chat.completions.create(model=server.engine.model_name, max_tokens=2,
                                       messages=[{"role": "user", "content": None}])
    assert e.value.body["param"] == "messages.0.content"


def test_completion_logprobs_have_every_field(client, server):
    tok = server.engine.tokenizer
    resp = client.completions.create(model=server.engine.model_name, prompt="12+30=", max_tokens=11, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True, "return_trace": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    n = len(choice.model_dump()["completion_ids"])
    assert n == 11 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs == pytest.approx(choice.model_dump()["trace"]["logprobs"])
    shown = [t for t, i in zip(lp.tokens, choice.model_dump()["completion_ids"]) if i not in tok.all_special_ids]
    assert "".join(shown) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob, abs=1e-4)
        assert max(top, key=top.get) == token  # greedy: the sampled token is the most likely one
        assert all(v <= 0 for v in top.values())


def test_chat_top_logprobs_have_k_entries(client, server):
    resp = client.chat.completions.create(model=server.engine.model_name, messages=[{"role": "user", "content": "7"}],
                                          max_tokens=6, seed=5, logprobs=True, top_logprobs=4,
                                          extra_body={"ignore_eos": True, "strategy": "static", "steps": 2})
    content = resp.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == resp.choices[0].message.content
    for c in content:
        values = [t.logprob for t in c.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert c.logprob <= values[0] + 1e-6 and bytes(c.bytes).decode() == c.token
        found = [t.logprob for t in c.top_logprobs if t.token == c.token]
        assert not found or found[0] == pytest.approx(c.logprob, abs=1e-4)
    plain = client.chat.completions.create(model=server.engine.model_name, max_tokens=3, seed=5, logprobs=True,
                                           messages=[{"role": "user", "content": "7"}])
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def test_stream_carries_logprobs_on_the_finish_chunk(client, server):
    chunks = list(client.completions.create(model=server.engine.model_name, prompt="5", max_tokens=7, seed=2,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    with_lp = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(with_lp) == 1 and len(with_lp[0].tokens) == 7 and len(with_lp[0].top_logprobs[0]) >= 2


@pytest.mark.parametrize("kwargs,param", [
    ({"echo": True, "logprobs": 1, "max_tokens": 4}, "echo"),
    ({"echo": True, "max_tokens": 0}, "max_tokens"),
])
def test_prompt_scoring_is_a_clear_400(client, server, kwargs, param):
    """A diffusion LM does not score prompt tokens: echo + logprobs / max_tokens 0 are refused with the reason."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.engine.model_name, prompt="1+1=", **kwargs)
    assert e.value.body["param"] == param and "log-likelihoods" in e.value.body["message"]


# --------------------------------------------------------------------------- stop strings in streams

def _block_straddling_stop(server, prompt: str, text_ids: list[int]) -> tuple[str, int]:
    """A 2-character stop string whose first occurrence in the text spans a block boundary."""
    tok, block = server.engine.tokenizer, server.engine.backend.block_size
    prompt_len = len(tok.encode(prompt, add_special_tokens=False))
    text = tok.decode(text_ids, skip_special_tokens=True)
    for j in range(1, len(text_ids)):
        if (prompt_len + j) % block == 0 and all(i not in tok.all_special_ids for i in text_ids[:j + 1]):
            stop = text[j - 1:j + 1]
            if text.index(stop) == j - 1:
                return stop, j - 1
    raise AssertionError("no block-straddling stop string in this sample")


@pytest.mark.parametrize("seed", [11, 12])
def test_stop_string_across_blocks_never_leaks_into_the_stream(client, server, seed):
    base = dict(model=server.engine.model_name, prompt="a", max_tokens=40, seed=seed,
                extra_body={"ignore_eos": True, "return_trace": True})
    full = client.completions.create(**base).choices[0].model_dump()
    stop, at = _block_straddling_stop(server, "a", full["completion_ids"])
    cut = client.completions.create(stop=[stop, "never-seen"], **base).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full["text"][:at]
    chunks = list(client.completions.create(stop=[stop, "never-seen"], stream=True, **base))
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == cut.text and stop[0] not in deltas[-1][-1:]


def test_hold_back_keeps_what_could_start_a_stop_string():
    from server.api.openai_api import hold_back

    assert hold_back("abcde", ["dex"]) == "abc"
    assert hold_back("abcde", ["e!", "cdez"]) == "ab"
    assert hold_back("abcde", ["xyz"]) == "abcde"
    assert hold_back("abc", []) == "abc" and hold_back("", ["a"]) == ""
