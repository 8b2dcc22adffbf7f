"""Unkind callers on a real server: lone surrogates, 8 MiB prompts, huge chat messages.

A lone surrogate is a 400 naming the field; a body over `server.max_body_bytes` is a 413
before it is read (Content-Length or chunked); a prompt over the cheap character bound
is a 413 before it is tokenised; and `/health` keeps answering in under a second while
such bodies are sent and rejected (tokenising never runs on the event loop).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server.api.state import server_state

EIGHT_MIB = 8 << 20


@pytest.mark.parametrize("endpoint,body,param", [
    ("/generate", '{"prompt": "ab\\ud800c"}', "prompt"),
    ("/generate", '{"prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/generate", '{"prompt": "a", "stop": ["\\ud800"]}', "stop.0"),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "a", "user": "\\udbff", "max_tokens": 2}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content.0.text"),
])
def test_lone_surrogate_is_a_400_naming_the_field(server, endpoint, body, param):
    r = httpx.post(server.url + endpoint, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]


def test_surrogate_in_a_key_is_a_400_naming_the_body(server):
    r = httpx.post(server.url + "/generate", content=b'{"prompt": "a", "\\ud800": 1}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


async def _health_latencies(url: str, done: asyncio.Event) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=30) as c:
        while not done.is_set() or not latencies:
            t0 = time.perf_counter()
            assert (await c.get(url + "/health")).status_code == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    return latencies


def _send_while_polling_health(url: str, path: str, **request) -> tuple[httpx.Response, list[float]]:
    async def main():
        done = asyncio.Event()
        poller = asyncio.create_task(_health_latencies(url, done))
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=120) as c:
            try:
                r = await c.post(url + path, **request)
            finally:
                done.set()
        return r, await poller

    return asyncio.run(main())


def _big_prompt() -> bytes:
    return json.dumps({"prompt": "7" * EIGHT_MIB, "max_tokens": 4}).encode()


def test_8mib_body_is_413_before_it_is_read_and_health_stays_fast(server):
    r, latencies = _send_while_polling_health(server.url, "/generate", content=_big_prompt(),
                                              headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text[:300]
    assert str(server.config.max_body_bytes) in r.json()["error"]["message"]
    assert max(latencies) < 1.0, latencies


def test_chunked_body_over_the_limit_is_413(server):
    data = _big_prompt()

    def chunks():
        for i in range(0, len(data), 1 << 20):
            yield data[i:i + (1 << 20)]

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


@pytest.fixture(scope="module")
def roomy_server(make_server):
    """A body limit above 8 MiB: the cheap length bound must refuse the prompt without tokenising it."""
    return make_server(max_batch=2, max_queue=8, max_model_len=256, max_body_bytes=16 << 20)


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"prompt": "7" * EIGHT_MIB, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": ["1", "7" * EIGHT_MIB], "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "7" * EIGHT_MIB}], "max_tokens": 4},
     "messages"),
])
def test_8mib_prompt_is_413_without_tokenising_and_health_stays_fast(roomy_server, path, body, param):
    r, latencies = _send_while_polling_health(roomy_server.url, path, json=body)
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and "characters cannot fit" in err["message"]
    assert max(latencies) < 1.0, latencies
    ok = httpx.post(roomy_server.url + path, json={**body, **({"prompt": "1+1="} if "prompt" in body else
                                                              {"messages": [{"role": "user", "content": "1"}]})},
                    timeout=60)
    assert ok.status_code == 200, ok.text


class _SlowTokenizer:
    """Wraps the handlers' tokenizer: every encode / chat template takes `delay` seconds."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def encode(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "1+2=", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+2"}], "max_tokens": 2}),
])
def test_tokenising_never_blocks_the_event_loop(roomy_server, path, body):
    prompts = server_state(roomy_server.app).prompts
    inner = prompts.tokenizer
    prompts.tokenizer = _SlowTokenizer(inner, delay=1.5)
    try:
        r, latencies = _send_while_polling_health(roomy_server.url, path, json=body)
    finally:
        prompts.tokenizer = inner
    assert r.status_code == 200, r.text
    assert len(latencies) >= 5 and max(latencies) < 1.0, latencies
