"""server.prefix_caching: a request's n samples and later requests with the same prefix share the prompt's
complete blocks (dlrl_prefix_cache_* count them), with the samples a server without sharing returns; a weight
push that lands mid-rollout leaves the next requests reading only pages of the new weights."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest
import torch

from dllm.decoding import generate
from dllm.model import SDARForCausalLM
from dllm.sampling import SamplingParams
from dllm.weights import copy_into_model
from server.engine.backends.native import NativeBackend
from server.engine.engine import Engine
from tests.helpers import tiny_config

PROMPT = [11, 23, 5, 42, 17, 8, 31, 2, 29, 14, 55, 6, 19, 40]  # 3 complete blocks of 4 + 2 tokens
BLOCKS = 12


def counters(url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    got = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name in ("dlrl_prefix_cache_queries", "dlrl_prefix_cache_hits"):
            got[fam.name] = fam.samples[0].value
    return got["dlrl_prefix_cache_queries"], got["dlrl_prefix_cache_hits"]


def samples(url: str, prompt: list[int], n: int) -> list[dict]:
    body = {"prompt_ids": prompt, "n": n, "seed": 7, "max_tokens": 12, "ignore_eos": True, "strategy": "static",
            "steps": 2}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["samples"]


def test_samples_share_the_prompt_and_match_a_server_without_sharing(server, make_server):
    off = make_server(max_batch=8, max_queue=64, max_model_len=256, prefix_caching=False)
    assert server.engine.info.prefix_sharing and not off.engine.info.prefix_sharing
    q0, h0 = counters(server.url)
    on_samples, off_samples = samples(server.url, PROMPT, 4), samples(off.url, PROMPT, 4)
    for a, b in zip(on_samples, off_samples, strict=True):
        assert a["completion_ids"] == b["completion_ids"] and a["trace"]["steps"] == b["trace"]["steps"]
        assert a["trace"]["logprobs"] == pytest.approx(b["trace"]["logprobs"], abs=1e-5)
    q1, h1 = counters(server.url)
    assert (q1 - q0, h1 - h0) == (4 * len(PROMPT), 3 * BLOCKS)  # the first sample computed the blocks
    assert counters(off.url)[1] == 0
    samples(server.url, PROMPT[:12] + [3, 3, 3], 1)  # another request, same first blocks: all found cached
    assert counters(server.url)[1] - h1 == BLOCKS


def test_a_push_mid_rollout_serves_new_requests_only_new_pages():
    """Request a (version 0) runs when an update lands: admission pauses, a ends on the old weights, the
    weights are copied, version 1; b, queued meanwhile with a's prompt, then decodes exactly as the new
    weights alone would -- its first sample finds none of a's cached pages, its second shares the first's."""
    torch.manual_seed(3)
    cfg = tiny_config(eos_token_id=0)
    model, pushed = SDARForCausalLM(cfg).eval(), SDARForCausalLM(cfg).eval()
    original = SDARForCausalLM(cfg).eval()
    original.load_state_dict(model.state_dict())
    params = SamplingParams(max_tokens=24, seed=11, strategy="static", steps=2, ignore_eos=True)
    backend = NativeBackend(model, None, max_batch=4, max_model_len=64, eos_ids=[0], kv_cache_memory=1 << 20)
    engine = Engine(backend, max_queue=16).start()

    async def main() -> tuple[list, list]:
        a = engine.submit(engine.make_sequences([PROMPT], replace(params), n=2))
        while engine.num_running < 2:
            await asyncio.sleep(0.001)
        update = asyncio.create_task(engine.apply_update(
            1, lambda: copy_into_model(engine.model, list(pushed.hf_named_tensors()))))
        while not engine.is_paused:
            await asyncio.sleep(0.001)
        b = engine.submit(engine.make_sequences([PROMPT], replace(params), n=2))  # queued behind the push
        done_a = await engine.wait(a)
        await update
        return done_a, await engine.wait(b)

    try:
        done_a, done_b = asyncio.run(main())
    finally:
        engine.shutdown()
    seeded = [replace(params, seed=11), replace(params, seed=12)]
    for got, weights, version in ((done_a, original, 0), (done_b, pushed, 1)):
        want = generate(weights, [PROMPT, PROMPT], seeded)
        assert [s.trace.version for s in got] == [version, version]
        for s, w in zip(got, want):
            assert s.completion_ids == w.completion_ids and s.trace.steps == w.trace.steps
            assert s.trace.logprobs == pytest.approx(w.trace.logprobs, abs=1e-5)
    blocks = engine.scheduler.blocks
    assert blocks.num_hit_tokens == 2 * BLOCKS  # a's second sample, b's second: never across the versions
    assert blocks.version == 1 and blocks.num_cached_pages == BLOCKS // 4  # version 0's pages retired
