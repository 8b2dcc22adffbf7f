"""Request fields are strict, as OpenAI's API is (issue 47): an unknown field is a 400 naming it, with
"did you mean" for a near miss; OpenAI fields this server does not implement are accepted only at their
neutral value (a 400 saying why otherwise: `response_format`, penalties, ...); no message
carries pydantic's "Value error, " prefix. Through the official `openai` client and raw HTTP.

    python -m pytest -q tests/server/test_server_fields.py
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest


def _error(server: Any, path: str, body: dict[str, Any]) -> tuple[int, str, str | None]:
    r = httpx.post(server.url + path, json=body, timeout=60)
    err = r.json().get("error") or {}
    return r.status_code, err.get("message", ""), err.get("param")


CHAT = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/completions", {"prompt": "1+1=", "max_token": 2}, "max_token", "did you mean 'max_tokens'?"),
    ("/v1/chat/completions", {**CHAT, "temprature": 0}, "temprature", "did you mean 'temperature'?"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "1+1=", "contnet": "x"}]},
     "messages.0.contnet", "did you mean 'content'?"),
    ("/v1/completions", {"prompt": "1+1=", "stream": True, "stream_options": {"include_usag": True}},
     "stream_options.include_usag", "did you mean 'include_usage'?"),
    ("/generate", {"prompt": "1+1=", "max_tokns": 2}, "max_tokns", "did you mean 'max_tokens'?"),
    ("/generate", {"prompt": "1+1=", "zzz": 1}, "zzz", "unrecognized request field; this server refuses"),
    ("/v1/completions", {"prompt": "1+1=", "response_format": {"type": "json_object"}}, "response_format",
     "constrained decoding (JSON mode, JSON schema) is not supported"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format", "parallel"),
    ("/v1/completions", {"prompt": "1+1=", "logit_bias": {"five": 2}}, "logit_bias", "keys must be token ids"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 0.5}, "frequency_penalty", "only 0"),
    ("/v1/completions", {"prompt": "1+1=", "best_of": 3}, "best_of", "best_of is not supported"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools", "tools are not supported"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", "0 asks for prompt log-likelihoods only"),
])
def test_refused_fields_are_named(server: Any, path: str, body: dict[str, Any], param: str, says: str) -> None:
    status, message, got = _error(server, path, body)
    assert status == 400 and got == param and says in message, (status, message, got)
    assert "Value error" not in message and "Extra inputs" not in message


def test_neutral_values_and_echoed_assistant_turns_are_accepted(server: Any) -> None:
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": "1+1=", "max_tokens": 2, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
        "response_format": {"type": "text"}, "best_of": 1, "suffix": None, "store": False, "user": "u"}, timeout=60)
    assert r.status_code == 200, r.text
    turn = {"role": "assistant", "content": "2", "refusal": None, "annotations": [], "audio": None,
            "function_call": None, "tool_calls": None}  # what a client sends back as OpenAI returned it
    r = httpx.post(server.url + "/v1/chat/completions", json={
        **CHAT, "messages": [CHAT["messages"][0], turn, {"role": "user", "content": "2+2="}],
        "parallel_tool_calls": True, "modalities": ["text"]}, timeout=60)
    assert r.status_code == 200, r.text


def test_the_openai_client_sees_the_400(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.engine.model_name, prompt="1+1=", max_tokens=2,
                                  extra_body={"max_token": 2})
    assert "max_token" in str(e.value) and "did you mean 'max_tokens'?" in str(e.value)
