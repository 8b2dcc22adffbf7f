"""server.backend=lmdeploy against a real LMDeploy PyTorch engine (GPU + lmdeploy: .lmdkit, README).

A small SDAR-shaped folder (2 layers, the stand-in Qwen tokenizer) served through the real server:
OpenAI completions and native /generate (trace-free), then an in-place push through dlrl's weight
sync (LMDeploy's sleep -> the uni executor's model agent's update_params -> wakeup) after which greedy
generations equal those of a fresh engine loaded from the pushed weights; closing the first releases
its executor. Skipped without CUDA or without lmdeploy.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers import ADMIN_TOKEN

pytestmark = pytest.mark.gpu

try:
    import lmdeploy  # noqa: F401
    HAVE_LMDEPLOY = True
except ImportError:
    HAVE_LMDEPLOY = False

needs = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_LMDEPLOY),
                           reason="needs a CUDA device and lmdeploy (benchmarks/lmdeploy_kit.sh on a GPU machine)")
PROMPTS = [[1000 + i, 2000 + i, 3000 + i, 4000 + i, 5000 + i] for i in range(4)]


def runner_for(folder: str):  # noqa: ANN201 - an LMDeployRunner
    from server.engine.backends.lmdeploy_runner import LMDeployRunner

    return LMDeployRunner.from_pretrained(folder, dtype="bfloat16", max_batch=8, max_model_len=512,
                                          kv_cache_fraction=0.2, strategy="dynamic", threshold=0.9)


def greedy(url: str) -> list[list[int]]:
    r = httpx.post(url + "/generate", json={"prompt_ids": PROMPTS, "max_tokens": 24, "temperature": 0,
                                            "ignore_eos": True}, timeout=300)
    assert r.status_code == 200, r.text
    return [s["completion_ids"] for s in r.json()["samples"]]


@needs
def test_lmdeploy_serves_pushes_and_matches_a_fresh_engine(make_server_for, small_sdar_dir, tmp_path):
    from openai import OpenAI

    from dllm.export import export_pretrained
    from dllm.weights import load_pretrained
    from weight_sync import push, weights_digest

    srv = make_server_for(small_sdar_dir, runner=runner_for(small_sdar_dir), admin_token=ADMIN_TOKEN, max_batch=8)
    out = OpenAI(base_url=srv.url + "/v1", api_key="none").completions.create(
        model=srv.engine.model_name, prompt="Hello", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    r = httpx.post(srv.url + "/generate", json={"prompt_ids": PROMPTS[0], "max_tokens": 8}, timeout=300).json()
    assert r["samples"][0]["trace"]["trace_free"] is True and r["samples"][0]["trace"]["backend"] == "lmdeploy"
    before = greedy(srv.url)

    new = load_pretrained(small_sdar_dir, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, t in new.hf_named_tensors():
            t.add_((0.05 * torch.randn(t.shape, generator=g)).to(t.dtype))
    push([srv.url], new.hf_named_tensors(), 1, transport="http", token=ADMIN_TOKEN)
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.get(srv.url + "/weights/version", headers=auth).json()["version"] == 1
    assert httpx.get(srv.url + "/weights/checksum", headers=auth).json()["digest"] == \
        weights_digest(new.hf_named_tensors())
    after = greedy(srv.url)
    assert after != before  # the engine serves the pushed weights (no stale weights or prefix cache)

    folder = tmp_path / "pushed"
    export_pretrained(new.hf_named_tensors(), new.config, folder, source_dir=small_sdar_dir)
    srv.stop()
    agent = srv.engine.backend.engine.executor.model_agent  # the uni executor's, where the push loaded
    srv.engine.shutdown()  # LMDeploy's engine and its memory go before the fresh one starts
    assert agent.patched_model is None  # its main task's cleanup ran: executor.release()
    fresh = make_server_for(str(folder), runner=runner_for(str(folder)), max_batch=8)
    assert greedy(fresh.url) == after
