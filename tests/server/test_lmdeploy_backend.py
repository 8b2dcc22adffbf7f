"""server.backend=lmdeploy on CPU: the real dlrl server (routes, OpenAI API, weight sync) over the
LMDeploy runner, with a double of LMDeploy's engine interface only (tests/server/lmdeploy_double.py).

The runner's tokens, stop rules, trace-free traces, 400s for what LMDeploy cannot honour, the
update order (sleep 2 -> wake weights -> update_params -> wake kv_cache) through the path the real
library takes on one GPU, a failed update rolled back and LMDeploy never left asleep, a request
LMDeploy cancelled failing as an error, and a close that lets LMDeploy release its executor. The
same checks against a real LMDeploy engine: tests/server/test_lmdeploy_gpu.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from types import SimpleNamespace

import httpx
import pytest
import torch

from dllm.decoding import generate
from dllm.sampling import SamplingParams
from dllm.tokenizer import eos_token_ids, load_tokenizer
from dllm.weights import load_pretrained
from server.engine.backends import BackendUnavailable, check_backend
from server.engine.backends.lmdeploy_params import DLLMSettings
from server.engine.backends.lmdeploy_runner import LMDeployRunner, load_lmdeploy
from tests.helpers import ADMIN_TOKEN, free_port
from tests.server.lmdeploy_double import (
    FakeLMDeployEngine,
    FlattenedTensorBucket,
    fake_api,
    serialize_state_dict,
)
from weight_sync import WeightSyncError, push, weights_digest

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def make_runner(model_dir: str, model: torch.nn.Module | None = None, executor: str = "uni") -> LMDeployRunner:
    host = load_pretrained(model_dir, device="cpu", dtype=torch.float32)
    tok = load_tokenizer(model_dir)
    settings = DLLMSettings.from_server(block_size=host.config.block_size, strategy="dynamic", steps=0,
                                        threshold=0.9)
    engine = FakeLMDeployEngine(model or host, executor=executor)
    return LMDeployRunner(engine, fake_api(), host, tok, settings=settings,
                          eos_ids=eos_token_ids(model_dir, tok, host.config.eos_ids), max_batch=4, max_len=256,
                          device="cpu", update_bucket_bytes=64 << 10)


@pytest.fixture(scope="module")
def srv(make_server_for, tiny_model_dir):
    return make_server_for(tiny_model_dir, runner=make_runner(tiny_model_dir), admin_token=ADMIN_TOKEN,
                           max_batch=4, keep_versions=2)


def native_greedy(model: torch.nn.Module, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return generate(model, [prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0].completion_ids


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_generate_streams_lmdeploy_tokens_trace_free(srv, tiny_model_dir):
    model = load_pretrained(tiny_model_dir, device="cpu", dtype=torch.float32)
    body = {"prompt_ids": [[5, 6, 7], [9, 10, 11, 12, 13]], "max_tokens": 11, "temperature": 0, "n": 2}
    r = post(srv.url, "/generate", body)
    assert r.status_code == 200, r.text
    samples = r.json()["samples"]
    assert len(samples) == 4
    for s in samples:
        want = native_greedy(model, s["prompt_ids"], 11)
        assert s["completion_ids"] == want  # block by block through dlrl's scheduler, nothing lost or added
        tr = s["trace"]
        assert tr["trace_free"] is True and tr["backend"] == "lmdeploy"
        assert tr["steps"] == [0] * len(want) and tr["logprobs"] == [0.0] * len(want)
        assert s["finish_reason"] in ("stop", "length") and (s["finish_reason"] == "stop") == (len(want) < 11)
    assert srv.engine.backend.engine.started


def test_request_sampling_reaches_lmdeploy(srv):
    engine = srv.engine.backend.engine
    r = post(srv.url, "/generate", {"prompt_ids": [4, 5], "max_tokens": 6, "temperature": 0.7, "top_k": 5,
                                    "top_p": 0.8, "seed": 3, "stop_token_ids": [9]})
    assert r.status_code == 200, r.text
    cfg = engine.requests[-1][2]
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.random_seed) == (6, 0.7, 5, 0.8, 3)
    assert 9 in cfg.stop_token_ids and cfg.bad_token_ids == [srv.engine.backend.mask_token_id]


def test_max_tokens_and_stop_strings_are_dlrl_s(srv):
    r = post(srv.url, "/generate", {"prompt": "12+3=", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    s = r.json()["samples"][0]
    assert len(s["completion_ids"]) == 5 and s["finish_reason"] == "length"
    text = s["text"]
    if len(text) > 1:  # a stop string cut by dlrl's post-processor; LMDeploy's request is cancelled
        r = post(srv.url, "/generate", {"prompt": "12+3=", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                        "stop": [text[1:]]})
        assert r.json()["samples"][0]["text"] == text[:1] and r.json()["samples"][0]["finish_reason"] == "stop"


def test_openai_client_works(srv):
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    out = client.completions.create(model=srv.engine.model_name, prompt="1+1=", max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 6
    chunks = list(client.completions.create(model=srv.engine.model_name, prompt="2+2=", max_tokens=8,
                                            temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path,body,field", [
    ("/generate", {"prompt": "1+", "strategy": "static"}, "strategy"),
    ("/generate", {"prompt": "1+", "threshold": 0.5}, "threshold"),
    ("/generate", {"prompt": "1+", "steps": 2}, "steps"),
    ("/generate", {"prompt": "1+", "temperature": 3.0}, "temperature"),
    ("/generate", {"prompt": "1+", "max_tokens": 0, "prompt_logprobs": 0}, "max_tokens"),  # prompt likelihoods
    ("/v1/completions", {"prompt": "1+", "max_tokens": 4, "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "1+", "max_tokens": 0, "echo": True, "logprobs": 0}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
])
def test_what_lmdeploy_cannot_honour_is_a_400(srv, path, body, field):
    r = post(srv.url, path, {"model": srv.engine.model_name, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: ") and "lmdeploy" in err["message"]


def perturbed(model_dir: str, seed: int) -> torch.nn.Module:
    m = load_pretrained(model_dir, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in m.hf_named_tensors():
            t.add_(0.5 * torch.randn(t.shape, generator=g))
    return m


def greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    r = post(url, "/generate", {"prompt_ids": prompts, "max_tokens": 9, "temperature": 0})
    assert r.status_code == 200, r.text
    return [s["completion_ids"] for s in r.json()["samples"]]


PROMPTS = [[5, 6, 7], [11, 3], [20, 21, 22, 23, 24]]


def test_push_uses_lmdeploy_update_path_and_matches_a_fresh_engine(make_server_for, tiny_model_dir):
    own = make_server_for(tiny_model_dir, runner=make_runner(tiny_model_dir), admin_token=ADMIN_TOKEN, max_batch=4)
    engine = own.engine.backend.engine
    new = perturbed(tiny_model_dir, 1)
    push([own.url], new.hf_named_tensors(), 1, transport="http", token=ADMIN_TOKEN)
    updates = [c for c in engine.calls if c.startswith("update_params")]
    assert len(updates) > 1 and updates[-1] == "update_params(finished)"  # several buckets, the last finishes
    assert engine.calls == ["sleep(2)", "wakeup(['weights'])", *updates, "wakeup(['kv_cache'])"]
    assert httpx.get(own.url + "/weights/version", headers=AUTH).json()["version"] == 1
    digest = httpx.get(own.url + "/weights/checksum", headers=AUTH).json()["digest"]
    assert digest == weights_digest(new.hf_named_tensors())  # the host copy follows what LMDeploy serves
    fresh = make_runner(tiny_model_dir, model=new)  # a fresh engine loaded with the new weights
    fresh_srv = make_server_for(tiny_model_dir, runner=fresh, max_batch=4)
    assert greedy(own.url, PROMPTS) == greedy(fresh_srv.url, PROMPTS)
    assert greedy(own.url, PROMPTS) == [native_greedy(new, p, 9) for p in PROMPTS]


def test_failed_lmdeploy_update_restores_the_served_weights(make_server_for, tiny_model_dir):
    own = make_server_for(tiny_model_dir, runner=make_runner(tiny_model_dir), admin_token=ADMIN_TOKEN,
                          max_batch=4, keep_versions=2)
    engine = own.engine.backend.engine
    before = greedy(own.url, PROMPTS)
    digest = httpx.get(own.url + "/weights/checksum", headers=AUTH).json()["digest"]
    engine.fail_updates(after=1)  # the second bucket of the update fails half-way
    with pytest.raises(WeightSyncError, match="injected update_params failure"):
        push([own.url], perturbed(tiny_model_dir, 2).hf_named_tensors(), 1, transport="http", token=ADMIN_TOKEN)
    assert httpx.get(own.url + "/weights/version", headers=AUTH).json()["version"] == 0
    assert httpx.get(own.url + "/weights/checksum", headers=AUTH).json()["digest"] == digest
    assert engine.calls[:5] == ["sleep(2)", "wakeup(['weights'])", "update_params", "update_params",
                                "wakeup(['kv_cache'])"]  # the failed push still woke LMDeploy
    assert engine.calls[-1] == "wakeup(['kv_cache'])" and engine.calls.count("sleep(2)") == 2  # pushed back
    assert not engine.sleeping_tags
    assert greedy(own.url, PROMPTS) == before  # LMDeploy serves the old weights again
    # then an update and a rollback to version 0, both through LMDeploy's path
    push([own.url], perturbed(tiny_model_dir, 3).hf_named_tensors(), 1, transport="http", token=ADMIN_TOKEN)
    assert greedy(own.url, PROMPTS) != before
    num_sleeps = engine.calls.count("sleep(2)")
    r = httpx.post(own.url + "/weights/rollback", json={"version": 0}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert engine.calls.count("sleep(2)") == num_sleeps + 1 and greedy(own.url, PROMPTS) == before


def update_request(named: list[tuple[str, torch.Tensor]]) -> SimpleNamespace:
    """An UpdateParamsRequest as LMDeploy's docs build it (serialize_state_dict of a FlattenedTensorBucket)."""
    bucket = FlattenedTensorBucket(named_tensors=[(n, t.detach().clone()) for n, t in named])
    payload = serialize_state_dict({"flattened_tensor": bucket.get_flattened_tensor(),
                                    "metadata": bucket.get_metadata()})
    return SimpleNamespace(serialized_named_tensors=payload, load_format="flattened_bucket", finished=True)


def test_the_double_routes_updates_as_lmdeploy_does(tiny_model_dir):
    """Pins the double to lmdeploy 0.18: only the Ray executor implements Engine.update_params, and a
    CUDA-IPC payload does not resolve in the process that made it (the uni executor's model agent)."""
    host = load_pretrained(tiny_model_dir, device="cpu", dtype=torch.float32)
    new = perturbed(tiny_model_dir, 1)
    uni = FakeLMDeployEngine(host)
    with pytest.raises(NotImplementedError):
        uni.update_params(update_request(new.hf_named_tensors()))
    with pytest.raises(RuntimeError, match="invalid device context"):
        uni.executor.model_agent.update_params(update_request(new.hf_named_tensors()))
    ray = FakeLMDeployEngine(host, executor="ray")
    ray.update_params(update_request(new.hf_named_tensors()))
    assert weights_digest(ray.model.hf_named_tensors()) == weights_digest(new.hf_named_tensors())


def test_a_failed_restore_never_serves_empty_or_stale_completions(make_server_for, tiny_model_dir):
    """The update and the push-back both fail: LMDeploy is awake again (a finally), and every request fails
    with an error naming the cause -- never an empty completion ending with "stop"."""
    own = make_server_for(tiny_model_dir, runner=make_runner(tiny_model_dir), admin_token=ADMIN_TOKEN,
                          max_batch=4)
    engine = own.engine.backend.engine
    engine.fail_updates(times=1000)
    with pytest.raises(WeightSyncError, match="restor"):
        push([own.url], perturbed(tiny_model_dir, 4).hf_named_tensors(), 1, transport="http", token=ADMIN_TOKEN)
    assert not engine.sleeping_tags  # woken, though both pushes failed
    r = post(own.url, "/generate", {"prompt_ids": [5, 6, 7], "max_tokens": 9, "temperature": 0})
    assert r.status_code == 500 and "restart the server" in r.text, r.text
    engine.fail_updates(times=0)  # a later full push that succeeds serves again
    new = perturbed(tiny_model_dir, 5)
    push([own.url], new.hf_named_tensors(), 2, transport="http", token=ADMIN_TOKEN)
    assert greedy(own.url, PROMPTS) == [native_greedy(new, p, 9) for p in PROMPTS]


def test_a_request_lmdeploy_cancelled_is_an_error(make_server_for, tiny_model_dir):
    """LMDeploy answers CANCEL with no tokens while asleep (and to requests in flight when it falls asleep):
    a 500 naming the cancel, not an empty completion with finish reason "stop"."""
    own = make_server_for(tiny_model_dir, runner=make_runner(tiny_model_dir), max_batch=4)
    engine = own.engine.backend.engine
    asyncio.run(engine.sleep(1))  # put to sleep behind dlrl's back
    r = post(own.url, "/generate", {"prompt_ids": [5, 6, 7], "max_tokens": 9, "temperature": 0})
    assert r.status_code == 500 and "cancel" in r.json()["error"]["message"], r.text
    r = post(own.url, "/v1/completions", {"model": own.engine.model_name, "prompt": "1+1=", "max_tokens": 4})
    assert r.status_code == 500, r.text
    engine.wakeup(None)
    model = load_pretrained(tiny_model_dir, device="cpu", dtype=torch.float32)
    assert greedy(own.url, PROMPTS) == [native_greedy(model, p, 9) for p in PROMPTS]  # awake: serves again


def test_close_lets_lmdeploy_release_its_executor(tiny_model_dir):
    """close() waits for LMDeploy's main task to clean up (executor.release(): its GPU memory) before it
    stops the loop."""
    runner = make_runner(tiny_model_dir)
    engine = runner.engine
    engine.release_after_s = 0.2  # the engine loop's tasks take a while to finish cancelling
    runner.close()
    assert engine.executor.released and not runner._loop.thread.is_alive()


def test_an_engine_without_an_in_process_model_agent_is_refused(tiny_model_dir):
    """dlrl applies weights through the uni executor's model agent; an engine built otherwise (a Ray
    executor: the model in another process) is refused at startup, not at the first push."""
    with pytest.raises(BackendUnavailable, match="server.backend=lmdeploy: .*RayExecutor"):
        make_runner(tiny_model_dir, executor="ray")


def test_the_handoff_loads_through_lmdeploys_own_update_params(monkeypatch):
    """With lmdeploy importable (the device kit; here: its wheel on PYTHONPATH): dlrl's in-process payload
    through lmdeploy's real BaseModelAgent.update_params (deserialiser, `_construct`, FlattenedTensorBucket,
    load_weights), on a stand-in agent holding a small model; every bucket taken, none left behind."""
    agent_mod = pytest.importorskip("lmdeploy.pytorch.engine.model_agent.agent")
    from lmdeploy.serve.openai.protocol import UpdateParamsRequest
    from lmdeploy.utils import FlattenedTensorBucket as RealBucket

    from server.engine.backends import lmdeploy_weights

    if not torch.cuda.is_available():  # the agent asks for its CUDA device and synchronises
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None:  # an LMDeploy model's loader
        params = dict(model.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)

    model.load_weights = load_weights
    agent = SimpleNamespace(all_context=contextlib.nullcontext, patched_model=SimpleNamespace(get_model=lambda: model),
                            spec_agent=SimpleNamespace(get_model=lambda: None, is_enabled=lambda: False),
                            _update_params_ipc_tensor=None, _update_params_ipc_event=None)
    new = [(n, torch.randn_like(p)) for n, p in model.named_parameters()]
    for i, part in enumerate([new[:2], new[2:]]):
        bucket = RealBucket(named_tensors=part)
        with lmdeploy_weights.handed_over(bucket.get_flattened_tensor(), bucket.get_metadata()) as payload:
            request = UpdateParamsRequest(serialized_named_tensors=payload, load_format="flattened_bucket",
                                          finished=i == 1)
            agent_mod.BaseModelAgent.update_params(agent, request)
    assert all(torch.equal(p.cpu(), dict(new)[n].cpu()) for n, p in model.named_parameters())
    assert not lmdeploy_weights._handed


def test_missing_lmdeploy_is_a_clear_error(tiny_model_dir, capsys):
    try:
        import lmdeploy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("lmdeploy is installed here: the missing-package error cannot be shown")
    with pytest.raises(BackendUnavailable, match=r"server.backend=lmdeploy: the lmdeploy package is not installed"):
        load_lmdeploy()
    with pytest.raises(BackendUnavailable, match="server.backend"):
        check_backend("lmdeploy")
    from server.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", tiny_model_dir, "--port", str(free_port()), "server.backend=lmdeploy"])
    assert e.value.code == 2
    assert "dlrl serve: error: server.backend=lmdeploy: the lmdeploy package is not installed" in capsys.readouterr().err


@pytest.mark.parametrize("options,key", [
    ({"device": "cpu"}, "server.device"), ({"kv_cache_memory": 1 << 30}, "server.kv_cache_memory"),
    ({"compile": True}, "server.compile"), ({"kv_admission": "optimistic"}, "server.kv_admission"),
    ({"cache_mode": "prefix"}, "server.cache_mode"), ({"further_horizon": 8}, "server.further_horizon"),
    ({"ranking": "tempered"}, "server.ranking"), ({"rng": "official"}, "server.rng"),
])
def test_native_only_options_name_the_key(options, key):
    from dlrl_config import ConfigError

    with pytest.raises(ConfigError, match=key):
        LMDeployRunner.from_pretrained("unused", **options)


def test_no_cuda_or_an_old_lmdeploy_is_a_clear_error(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("lmdeploy")
    monkeypatch.setitem(sys.modules, "lmdeploy", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fake, "__version__", "0.18.0", raising=False)
    with pytest.raises(BackendUnavailable, match="server.backend=lmdeploy: .*needs a CUDA device"):
        load_lmdeploy()
    monkeypatch.setattr(fake, "__version__", "0.12.3")  # Engine.sleep not yet async
    with pytest.raises(BackendUnavailable, match=r"server.backend=lmdeploy: lmdeploy 0.12.3 is too old.*>= 0.13"):
        load_lmdeploy()


def test_cache_mode_under_lmdeploy_is_refused_by_name(tiny_model_dir):
    """`dlrl serve server.backend=lmdeploy server.cache_mode=prefix`: refused naming the key (it used to be
    dropped on the way to the backend), before lmdeploy is even imported."""
    from dlrl_config import ConfigError
    from server.cli import backend_options, build_engine
    from server.config import ServerConfig

    cfg = ServerConfig(model=tiny_model_dir, backend="lmdeploy", cache_mode="prefix")
    assert backend_options(cfg)["cache_mode"] == "prefix"
    with pytest.raises(ConfigError, match=r"^server\.cache_mode: the native full-attention runner's"):
        build_engine(cfg, tiny_model_dir)
