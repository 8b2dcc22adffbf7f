"""One request never fails the batch: tiny temperatures, non-finite rows and any schema-valid sampling options."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dllm.decoding import generate
from dllm.sampling import SamplingParams
from dllm.tokenizer import encode
from server.engine.engine import RequestFailed
from tests.helpers import OverflowingParams


def reference(server, prompt_ids, **params):
    return generate(server.engine.model, [prompt_ids], SamplingParams(**params), tokenizer=server.engine.tokenizer)[0]


async def together(engine, start):
    """Queue everything `start()` sends while the engine is paused, so it all shares forwards."""
    await engine.pause()
    try:
        task = asyncio.ensure_future(start())
        while engine.num_waiting == 0 and not task.done():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the other requests reach the queue too
    finally:
        await engine.resume()
    return await task


@pytest.mark.slow
def test_tiny_temperature_among_fifteen_requests(server):
    prompt = encode(server.engine.tokenizer, "12+34=")
    bodies = [{"prompt_ids": prompt, "max_tokens": 12, "seed": i, "ignore_eos": True} for i in range(15)]
    bodies.insert(7, {"prompt_ids": prompt, "max_tokens": 12, "temperature": 1e-38, "ignore_eos": True})

    async def send():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(server.url + "/generate", json=b) for b in bodies))

    responses = asyncio.run(together(server.engine, send))
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses if r.status_code != 200]
    greedy = reference(server, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert responses[7].json()["samples"][0]["completion_ids"] == greedy.completion_ids  # below the floor: greedy
    for i in (0, 14):
        want = reference(server, prompt, max_tokens=12, seed=i, ignore_eos=True)
        assert responses[i + (i >= 7)].json()["samples"][0]["completion_ids"] == want.completion_ids


@pytest.mark.slow
def test_non_finite_row_ends_only_its_own_request(server):
    engine, tok = server.engine, server.engine.tokenizer
    prompt = encode(tok, "7+5=")
    bad = OverflowingParams(max_tokens=12, temperature=1e-45, ignore_eos=True)

    async def send():
        failing = engine.submit(engine.make_sequences([prompt], bad, n=2))
        async with httpx.AsyncClient(timeout=120) as c:
            good = [asyncio.ensure_future(c.post(server.url + "/generate", json={
                "prompt_ids": prompt, "max_tokens": 12, "seed": i, "ignore_eos": True, "return_trace": True}))
                for i in range(3)]
            with pytest.raises(RequestFailed, match="sample 0: sampling failed: .* not finite"):
                await engine.wait(failing)
            return await asyncio.gather(*good)

    responses = asyncio.run(together(engine, send))
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        want = reference(server, prompt, max_tokens=12, seed=i, ignore_eos=True)
        sample = r.json()["samples"][0]
        assert sample["completion_ids"] == want.completion_ids and sample["trace"]["steps"] == want.trace.steps
    assert engine.num_running == 0 and engine.scheduler.num_free_slots == engine.backend.max_batch


floats = st.floats(allow_nan=False, allow_infinity=False)
OPTIONS = st.fixed_dictionaries({"prompt": st.just("12+34="), "max_tokens": st.integers(1, 12)}, optional={
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 1e-38, 5e-324, 9.99e-6, 1e-5, 100.0]) | floats.filter(lambda t: 0 <= t <= 100),
    "top_k": st.integers(0, 2**40), "top_p": floats.filter(lambda p: 0 < p <= 1),
    "strategy": st.sampled_from(["static", "dynamic", "sequential"]), "steps": st.none() | st.integers(1, 2**31),
    "threshold": floats.filter(lambda t: 0 <= t <= 1), "seed": st.none() | st.integers(0, 2**63 - 1),
    "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.none() | st.lists(st.integers(-2**63, 2**63 - 1), max_size=3),
    "ignore_eos": st.booleans(),
})
_witness: dict = {}
WITNESS = {"prompt": "33+4=", "max_tokens": 8, "seed": 99, "temperature": 0.8, "top_k": 20, "ignore_eos": True}


@pytest.mark.slow
@settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=OPTIONS)
def test_any_schema_valid_options_never_5xx_and_leave_others_alone(server, body):
    if "want" not in _witness:
        _witness["want"] = reference(server, encode(server.engine.tokenizer, WITNESS["prompt"]),
                                     **{k: v for k, v in WITNESS.items() if k != "prompt"})
    want = _witness["want"]

    async def send():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(c.post(server.url + "/generate", json=body),
                                        c.post(server.url + "/generate", json=WITNESS))

    hostile, witness = asyncio.run(send())
    assert hostile.status_code < 500, (body, hostile.text)
    assert hostile.status_code in (200, 400), (body, hostile.text)
    assert witness.status_code == 200 and witness.json()["samples"][0]["completion_ids"] == want.completion_ids
