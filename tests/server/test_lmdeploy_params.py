"""dlrl SamplingParams -> LMDeploy's PytorchEngineConfig / GenerationConfig (pure Python, CPU):
every field mapped, and what LMDeploy cannot honour refused with a FieldError naming the field."""

from __future__ import annotations

import pytest

from dllm.errors import FieldError
from dllm.sampling import SamplingParams
from dlrl_config import ConfigError
from server.engine.backends.lmdeploy_params import (
    DLLMSettings,
    check_decoding,
    engine_kwargs,
    generation_kwargs,
)

DYNAMIC = DLLMSettings.from_server(block_size=4, strategy="dynamic", steps=0, threshold=0.9)
STATIC = DLLMSettings.from_server(block_size=4, strategy="static", steps=2, threshold=0.9)


def gen(params: SamplingParams, settings: DLLMSettings = DYNAMIC, eos: list[int] | None = None) -> dict:
    return generation_kwargs(params, settings, eos_ids=[0] if eos is None else eos, mask_token_id=63)


@pytest.mark.parametrize("strategy,unmasking", [("static", "low_confidence_static"),
                                                ("dynamic", "low_confidence_dynamic"), ("sequential", "sequential")])
def test_engine_config_carries_the_dllm_settings(strategy, unmasking):
    s = DLLMSettings.from_server(block_size=4, strategy=strategy, steps=0, threshold=0.85)
    kw = engine_kwargs(s, max_batch=32, max_len=4096, dtype="auto", kv_cache_fraction=0.8, cuda_graphs=True)
    assert kw == {"dtype": "auto", "max_batch_size": 32, "session_len": 4096, "cache_max_entry_count": 0.8,
                  "distributed_executor_backend": "uni",  # the model agent in this process (lmdeploy_weights)
                  "eager_mode": False, "enable_prefix_caching": False, "dllm_block_length": 4,
                  "dllm_unmasking_strategy": unmasking, "dllm_denoising_steps": 4, "dllm_confidence_threshold": 0.85}


def test_engine_config_limits_name_the_server_key():
    kw = engine_kwargs(DYNAMIC, max_batch=1, max_len=64, dtype="bfloat16", kv_cache_fraction=1.0, cuda_graphs=False)
    assert kw["cache_max_entry_count"] == 0.95 and kw["eager_mode"] is True and kw["dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="server.dtype"):
        engine_kwargs(DYNAMIC, max_batch=1, max_len=64, dtype="float32", kv_cache_fraction=0.5, cuda_graphs=False)
    with pytest.raises(ConfigError, match="server.lmdeploy_steps.*divide"):
        DLLMSettings.from_server(block_size=4, strategy="static", steps=3, threshold=0.9)
    with pytest.raises(ConfigError, match="server.lmdeploy_steps"):
        DLLMSettings.from_server(block_size=4, strategy="static", steps=8, threshold=0.9)


def test_sampling_fields_map_to_generation_config():
    kw = gen(SamplingParams(max_tokens=17, temperature=0.7, top_k=5, top_p=0.9, seed=11, stop_token_ids=[7, 3]))
    assert kw == {"max_new_tokens": 17, "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9,
                  "random_seed": 11, "stop_token_ids": [0, 3, 7], "ignore_eos": False, "bad_token_ids": [63],
                  "skip_special_tokens": False}


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_below_the_floor(temperature):
    kw = gen(SamplingParams(temperature=temperature))
    assert kw["do_sample"] is False and kw["temperature"] == 0.0


def test_eos_and_ignore_eos():
    assert gen(SamplingParams(), eos=[0, 5])["stop_token_ids"] == [0, 5]
    kw = gen(SamplingParams(ignore_eos=True, stop_token_ids=[9]), eos=[0, 5])
    assert kw["stop_token_ids"] is None and kw["ignore_eos"] is False  # generate past them; never ban them
    assert gen(SamplingParams(), eos=[])["stop_token_ids"] is None


@pytest.mark.parametrize("params,settings,field", [
    (SamplingParams(strategy="static"), DYNAMIC, "strategy"),
    (SamplingParams(strategy="sequential", steps=2), STATIC, "strategy"),
    (SamplingParams(threshold=0.5), DYNAMIC, "threshold"),
    (SamplingParams(steps=2), DYNAMIC, "steps"),
    (SamplingParams(strategy="static", steps=4), STATIC, "steps"),
    (SamplingParams(strategy="static"), STATIC, "steps"),  # None = block size, the engine decodes in 2
    (SamplingParams(temperature=2.5), DYNAMIC, "temperature"),
    (SamplingParams(logit_bias={5: -100.0}), DYNAMIC, "logit_bias"),  # LMDeploy cannot bias every forward
])
def test_what_lmdeploy_cannot_honour_names_the_field(params, settings, field):
    with pytest.raises(FieldError) as e:
        gen(params, settings)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_what_matches_the_engine_is_accepted():
    check_decoding(SamplingParams(steps=4, threshold=0.9), DYNAMIC)  # dynamic: steps unset or the block size
    check_decoding(SamplingParams(strategy="static", steps=2, threshold=0.1), STATIC)  # threshold: dynamic only
    assert gen(SamplingParams(temperature=2.0))["temperature"] == 2.0
    assert "2 steps" in STATIC.describe() and "low_confidence_static" in STATIC.describe()
