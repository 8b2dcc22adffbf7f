"""RolloutClient against real servers (and a mock transport for retry paths)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
from pydantic import ValidationError

from dllm.trace import Trace
from rollout_client import Rollout, RolloutClient, RolloutError
from rollout_client.protocol.common import Usage
from rollout_client.protocol.native import GenerateResponse, Sample

DEAD = "http://127.0.0.1:9"  # discard port: connection refused


@pytest.fixture(scope="module")
def server2(make_server):
    return make_server(max_batch=4, max_queue=64, max_model_len=256)


def run(coro):
    return asyncio.run(coro)


async def _generate(servers, prompts, n=1, **kw):
    client_kw = {k: kw.pop(k) for k in ("policy", "max_retries", "retry_backoff", "chunk_size") if k in kw}
    async with RolloutClient(servers, timeout=60, **client_kw) as client:
        return await client.generate(prompts, n=n, **kw)


def test_generate_text_and_ids(server):
    tok = server.engine.tokenizer
    prompts = ["1+2=", tok.encode("3+4=", add_special_tokens=False), "5+6="]
    rollouts = run(_generate([server.url], prompts, n=2, max_tokens=8, seed=0))
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(p, i) for p in range(3) for i in range(2)]
    for r in rollouts:
        assert isinstance(r, Rollout) and r.server == server.url and r.version == 0
        assert r.prompt_ids == tok.encode(["1+2=", "3+4=", "5+6="][r.prompt_index], add_special_tokens=False)
        assert r.logprobs == r.trace.logprobs and len(r.logprobs) == len(r.completion_ids)
        assert r.finish_reason in ("stop", "length")


def test_matches_server_samples(server):
    """Rollouts carry exactly what /generate returns for the same request."""
    body = {"prompt": ["7+7="], "n": 3, "max_tokens": 10, "seed": 42, "strategy": "static", "steps": 2}
    direct = httpx.post(server.url + "/generate", json=body, timeout=60).json()["samples"]
    rollouts = run(_generate([server.url], ["7+7="], n=3, max_tokens=10, seed=42, strategy="static", steps=2))
    assert [r.completion_ids for r in rollouts] == [s["completion_ids"] for s in direct]
    assert [r.trace.steps for r in rollouts] == [s["trace"]["steps"] for s in direct]


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_spreads_over_servers(server, server2, policy):
    prompts = [f"{i}+1=" for i in range(6)]
    rollouts = run(_generate([server.url, server2.url], prompts, n=2, max_tokens=6, policy=policy))
    assert len(rollouts) == 12 and [r.prompt_index for r in rollouts] == [i // 2 for i in range(12)]
    assert {r.server for r in rollouts} == {server.url, server2.url}
    for p in range(6):  # all samples of a prompt come from one server
        assert len({r.server for r in rollouts if r.prompt_index == p}) == 1


def test_dead_server_is_retried_elsewhere(server):
    rollouts = run(_generate([DEAD, server.url], ["1=", "2="], max_tokens=4, chunk_size=1, retry_backoff=0.01))
    assert len(rollouts) == 2 and all(r.server == server.url for r in rollouts)


def test_all_dead_raises_after_retries():
    with pytest.raises(RolloutError, match="after 3 attempt"):
        run(_generate([DEAD], ["1="], max_tokens=4, max_retries=2, retry_backoff=0.01))


def test_bad_request_is_not_retried(server):
    with pytest.raises(RolloutError) as e:
        run(_generate([server.url], ["x" * 500], max_tokens=4))
    assert e.value.status == 413 and "param=prompt" in str(e.value)


def test_client_side_validation():
    with pytest.raises(ValidationError):
        run(_generate([DEAD], ["1="], n=0))
    with pytest.raises(ValidationError):
        run(_generate([DEAD], ["1="], strategy="beam"))
    with pytest.raises(ValueError, match="policy"):
        RolloutClient([DEAD], policy="random")


def test_retries_503_then_succeeds():
    calls = []
    ok = GenerateResponse(id="g", model="m", version=3, usage=Usage(), samples=[Sample(
        index=0, prompt_index=0, prompt_ids=[5], completion_ids=[6, 0], text="1", finish_reason="stop", version=3,
        trace=Trace(prompt_len=1, block_size=4, steps=[1, 1], logprobs=[-0.5, -0.1], version=3))])

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) < 3:
            return httpx.Response(503, json={"error": {"message": "paused", "code": 503}})
        return httpx.Response(200, content=ok.model_dump_json())

    async def main():
        async with RolloutClient(["http://a", "http://b"], retry_backoff=0.01,
                                 transport=httpx.MockTransport(handler)) as client:
            return await client.generate([[5]], max_tokens=2)

    (r,) = run(main())
    assert len(calls) == 3 and calls[0]["prompt_ids"] == [[5]]
    assert r.version == 3 and r.logprobs == [-0.5, -0.1] and r.completion_ids == [6, 0]


def test_health_and_wait_ready(server):
    async def main():
        async with RolloutClient([server.url, DEAD], timeout=5) as client:
            health = await client.health()
            assert health[server.url].status == "ok" and health[DEAD] is None
            with pytest.raises(TimeoutError, match="127.0.0.1:9"):
                await client.wait_ready(timeout=0.3)
        async with RolloutClient([server.url]) as client:
            await client.wait_ready(timeout=10)

    run(main())


def test_the_client_and_every_schema_import_without_torch():
    """Trainers and tools use the client without the model stack: no module it imports pulls torch in."""
    code = ("import sys, pkgutil, importlib, rollout_client, rollout_client.protocol as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module(f'rollout_client.protocol.{m.name}')\n"
            "assert 'torch' not in sys.modules, sorted(n for n in sys.modules if n.startswith(('torch', 'dllm')))\n"
            "assert 'dllm.trace' in sys.modules and 'dllm.strategy' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
