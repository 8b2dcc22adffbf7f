"""Prompt log-likelihoods of LLaDA and Dream servers over HTTP (issue 47): native /generate with prompt_logprobs
and OpenAI echo + logprobs answer with LLaDA's Monte Carlo ELBO (dllm.full.likelihood, `server.elbo_samples`
samples, seeded by the request), with the standard errors of the suffix sums; `likelihood: sequential` is a
400 naming the field.

    python -m pytest -q tests/server/test_server_full_likelihood.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dllm.embedded.full_folders import build_full_folder
from dllm.full.likelihood import elbo_logprobs
from tests.conftest import RunningServer, start_server


@pytest.fixture(scope="module", params=["llada", "dream"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = build_full_folder(Path(tmp_path_factory.mktemp(request.param)), request.param, seed=2)
    srv = start_server(str(folder), build=True, block_size=4, max_batch=2, elbo_samples=6)
    yield srv
    srv.stop()


def test_native_prompt_logprobs_are_the_elbo_with_its_stderr(served: Any) -> None:
    r = httpx.post(served.url + "/generate", json={"prompt": ["12+7=19", "3+4=7"], "max_tokens": 0,
                                                    "prompt_logprobs": 0, "seed": 11}, timeout=120)
    assert r.status_code == 200, r.text
    for sample in r.json()["samples"]:
        ids = sample["prompt_ids"]
        (ref,) = elbo_logprobs(served.engine.model, [ids], num_samples=6, seed=11)
        assert sample["likelihood"] == "elbo" and sample["likelihood_samples"] == 6
        assert sample["num_forwards"] == (len(ids) - 1) * 6
        assert sample["prompt_logprobs"][0] is None and sample["prompt_logprobs_stderr"][0] is None
        assert sample["prompt_logprobs"][1:] == pytest.approx(ref.logprobs[1:], abs=1e-5)
        assert all(se >= 0 for se in sample["prompt_logprobs_stderr"][1:])
        assert sample["prompt_logprobs_stderr"][-1] == pytest.approx(0.0, abs=1e-9)  # one token masked: exact


def test_openai_echo_logprobs_carry_the_stderr(served: Any) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model=served.engine.model_name, prompt="12+7=19", echo=True, logprobs=1,
                                  max_tokens=0, seed=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    extra = lp.model_extra or {}
    assert len(extra["suffix_stderr"]) == len(lp.token_logprobs) and extra["suffix_stderr"][0] is None
    r2 = httpx.post(served.url + "/v1/completions", json={"prompt": "12+7=19", "echo": True, "logprobs": 1,
                                                          "max_tokens": 0, "likelihood": "sequential"}, timeout=60)
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "likelihood"
