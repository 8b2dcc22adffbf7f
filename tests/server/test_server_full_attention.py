"""Full-attention models served like SDAR: tiny official-layout LLaDA and Dream folders behind real HTTP
servers (server.engine.backends.full_attention, picked by create_backend from the folder's family), in both
cache modes: /v1/models, native /generate with traces (exact mode: the trace replays to < 1e-4), the
official `openai` client with the family's chat template and logprobs, refusals by field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dllm.embedded.full_folders import build_dream_folder, build_llada_folder
from dllm.full.replay import full_trace_hidden
from dllm.replay import token_logprobs
from dlrl_config import ConfigError
from rollout_client.protocol.native import Sample
from tests.conftest import RunningServer, start_server

CASES = [("llada", "exact"), ("llada", "prefix"), ("dream", "exact"), ("dream", "prefix")]


def _serve(model_dir: str, **overrides: Any) -> RunningServer:
    return start_server(model_dir, build=True, block_size=4, max_batch=4, **overrides)  # the family picks the runner


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("full-folders")
    return {"llada": str(build_llada_folder(root / "llada")), "dream": str(build_dream_folder(root / "dream"))}


@pytest.fixture(scope="module")
def servers(folders: dict[str, str]) -> Iterator[dict[tuple[str, str], RunningServer]]:
    started = {(fam, mode): _serve(folders[fam], cache_mode=mode) for fam, mode in CASES}
    yield started
    for s in started.values():
        s.server.should_exit = True
    for s in started.values():
        s.thread.join(timeout=15)


@pytest.mark.parametrize("family,mode", CASES)
def test_models_and_native_generate_with_traces(servers: dict, family: str, mode: str) -> None:
    srv = servers[(family, mode)]
    card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
    assert (card["family"], card["cache_mode"]) == (family, mode)
    body = {"prompt": ["12+34=", "7+8="], "n": 2, "max_tokens": 9, "strategy": "static", "steps": 2,
            "temperature": 1.0, "seed": 3, "return_trace": True}
    r = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    samples = [Sample.model_validate(s) for s in r.json()["samples"]]
    assert len(samples) == 4
    model, diffs = srv.engine.model, []
    for s in samples:
        tr = s.trace
        assert tr is not None and tr.cache_mode == mode and tr.block_size == 4
        assert len(tr.steps) == len(tr.logprobs) == len(s.completion_ids) > 0
        assert tr.canvas_len == len(s.prompt_ids) + 12 and tr.block_origin == len(s.prompt_ids)  # from the prompt's end
        assert tr.schedule == ("llada" if family == "llada" else "dream eps=0.001")
        assert tr.further_horizon == (None if mode == "exact" else {"llada": 128, "dream": 32}[family])
        assert model.config.mask_token_id not in s.completion_ids and 1 <= min(tr.steps) <= max(tr.steps) <= 2
        with torch.no_grad():  # the trainer's replay of this sample under the served weights
            lp = token_logprobs(model.lm_head(full_trace_hidden(model, s)), torch.tensor(s.completion_ids),
                                model.config.mask_token_id)
        diffs.append((lp - torch.tensor(tr.logprobs)).abs().max().item())
    if mode == "exact":
        assert max(diffs) < 1e-4, diffs  # the replay invariant over HTTP
    else:  # the prefix cache's stale K/V: the sampler's log-probs are not the replay's (TIS / MIS correct it)
        assert 1e-6 < max(diffs) < 5.0, diffs


@pytest.mark.parametrize("family,mode", [("llada", "exact"), ("dream", "prefix")])
def test_openai_client_chat_with_template_and_logprobs(servers: dict, family: str, mode: str) -> None:
    from openai import OpenAI

    srv = servers[(family, mode)]
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "1+1="}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"strategy": "static", "return_trace": True})
    choice = chat.choices[0]
    assert choice.finish_reason in ("stop", "length") and chat.usage is not None
    prompt_tokens = chat.usage.prompt_tokens
    tok = srv.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False)
    assert "<|start_header_id|>" in text or "<|im_start|>" in text  # the family's own template
    assert prompt_tokens == len(tok.encode(text, add_special_tokens=False))  # applied server-side
    assert choice.logprobs is not None and choice.logprobs.content
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    done = client.completions.create(model=model, prompt="12+34=", max_tokens=5, temperature=0,
                                     extra_body={"strategy": "static"})
    assert done.choices[0].text is not None


def test_refusals_name_the_field(servers: dict, folders: dict[str, str], tiny_model_dir: str) -> None:
    srv = servers[("llada", "exact")]
    mask = srv.engine.model.config.mask_token_id
    r = httpx.post(srv.url + "/generate", json={"prompt_ids": [5, mask], "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and "prompt_ids" in r.text
    r = httpx.post(srv.url + "/generate", json={"prompt": "1+1=", "max_tokens": 4, "strategy": "static",
                                                "steps": 9}, timeout=30)
    assert r.status_code == 400 and "steps" in r.text
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "1+1=", "max_tokens": 0, "echo": True,
                                                      "logprobs": 1, "likelihood": "sequential"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "likelihood" and "full-attention" in r.text
    from server.cli import build_engine
    from server.config import ServerConfig

    with pytest.raises(ConfigError, match=r"server\.cache_mode: 'prefix' applies to full-attention"):
        build_engine(ServerConfig(model=tiny_model_dir, device="cpu", cache_mode="prefix"), tiny_model_dir)
    with pytest.raises(ConfigError, match=r"server\.cuda_graphs: CUDA graphs need a CUDA device"):
        build_engine(ServerConfig(model=folders["llada"], device="cpu", cuda_graphs=True), folders["llada"])
    with pytest.raises(ConfigError, match=r"server\.rng: 'official' .* runs eagerly"):
        build_engine(ServerConfig(model=folders["llada"], device="cpu", compile=True, rng="official"), folders["llada"])
    with pytest.raises(ConfigError, match=r"server\.further_horizon: 8 applies to full-attention"):
        build_engine(ServerConfig(model=tiny_model_dir, device="cpu", further_horizon=8), tiny_model_dir)
    eng = build_engine(ServerConfig(model=folders["dream"], device="cpu", compile=True, cache_mode="prefix"),
                       folders["dream"])  # the static-shape step, compiled per bucket on first use
    assert eng.backend.static is not None and eng.backend.static.cache is not None
    assert Path(folders["dream"], "config.json").is_file()
