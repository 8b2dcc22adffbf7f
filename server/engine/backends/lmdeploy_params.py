"""dlrl's sampling parameters -> LMDeploy's (pure Python: no lmdeploy, no torch).

    settings = DLLMSettings.from_server(block_size=4, strategy="dynamic", steps=0, threshold=0.9)
    engine_kwargs(settings, max_batch=16, max_len=4096, dtype="auto", kv_cache_fraction=0.8,
                  cuda_graphs=False)                    # -> PytorchEngineConfig(**kwargs)
    generation_kwargs(params, settings, eos_ids=[2], mask_token_id=63)   # -> GenerationConfig(**kwargs)

LMDeploy's PyTorch engine decodes SDAR blocks with settings fixed for the whole engine
(`PytorchEngineConfig.dllm_block_length`, `dllm_unmasking_strategy`, `dllm_denoising_steps`,
`dllm_confidence_threshold`); only the sampling of each token is per request
(`GenerationConfig`). So the server's decoding defaults (`server.default_strategy`,
`server.default_threshold`, `server.lmdeploy_steps`, the block size) become the engine's
settings, and a request whose decoding differs from them is refused with a FieldError naming
the field (the server answers 400), never decoded some other way in silence:

- `strategy`: static -> `low_confidence_static`, dynamic -> `low_confidence_dynamic`,
  sequential -> `sequential`; another strategy than the engine's is refused.
- `steps`: static / sequential unmask `block_size // steps` tokens per forward (LMDeploy's rule),
  so the engine's steps must divide the block size (ConfigError at startup) and a request's
  steps (None = the engine's) must equal them; dynamic commits at least one token per forward
  (LMDeploy's rule), so a dynamic request may only leave steps unset or give the block size.
- `threshold`: dynamic only; must equal the engine's.
- `temperature`: below `dllm.sampling.GREEDY_BELOW` -> 0 (LMDeploy: greedy, top_k 1); LMDeploy
  accepts at most 2, so a higher one is refused.
- `top_k` (0 = off), `top_p`, `max_tokens` -> `max_new_tokens`, `seed` -> `random_seed` (LMDeploy
  draws its own noise: a seeded request is reproducible on LMDeploy, with other tokens than the
  native engine's).
- `stop_token_ids` add to the model's eos ids (as the native backend); `ignore_eos` -> no stop
  ids at all (LMDeploy's own `ignore_eos` would ban the eos tokens instead: another
  distribution). `stop` strings stay with dlrl's post-processor (LMDeploy's `stop_words` match
  token pieces, not text); the runner cancels the LMDeploy request once one matched.
- the mask token is passed as a bad token: it is never sampled (docs/DESIGN.md).
- `logit_bias` is refused (a FieldError naming it): LMDeploy's GenerationConfig cannot bias the logits of
  every denoising forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm.errors import FieldError
from dllm.sampling import GREEDY_BELOW, SamplingParams
from dllm.strategy import Strategy
from dlrl_config import ConfigError

MAX_TEMPERATURE = 2.0  # lmdeploy.GenerationConfig.__post_init__ asserts temperature in [0, 2]
UNMASKING = {Strategy.static: "low_confidence_static", Strategy.dynamic: "low_confidence_dynamic",
             Strategy.sequential: "sequential"}
DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16"}  # PytorchEngineConfig.dtype


@dataclass(frozen=True)
class DLLMSettings:
    """The engine-wide decoding of LMDeploy's dLLM mode, from the server's defaults."""

    block_size: int
    strategy: Strategy
    steps: int        # denoising steps per block (static / sequential)
    threshold: float  # dynamic's confidence threshold

    @classmethod
    def from_server(cls, *, block_size: int, strategy: str, steps: int, threshold: float) -> DLLMSettings:
        """Check the server's keys (ConfigError naming the key); steps 0 = the block size."""
        if block_size < 1:
            raise ConfigError(f"server.block_size: the model's block size must be >= 1, got {block_size}")
        steps = steps or block_size
        if not 1 <= steps <= block_size or block_size % steps:
            raise ConfigError(f"server.lmdeploy_steps: LMDeploy unmasks block_size // steps tokens per forward, so "
                              f"steps must divide the block size {block_size}; got {steps}")
        return cls(block_size, Strategy(strategy), steps, float(threshold))

    @property
    def unmasking(self) -> str:
        return UNMASKING[self.strategy]

    def describe(self) -> str:
        return (f"LMDeploy dLLM decoding (engine-wide): block {self.block_size}, {self.unmasking}, "
                f"{self.steps} steps, threshold {self.threshold}")


def engine_kwargs(settings: DLLMSettings, *, max_batch: int, max_len: int, dtype: str, kv_cache_fraction: float,
                  cuda_graphs: bool) -> dict[str, object]:
    """Keyword arguments of `lmdeploy.PytorchEngineConfig` (ConfigError naming the server key)."""
    if dtype not in DTYPES:
        raise ConfigError(f"server.dtype: LMDeploy's PyTorch engine serves auto, bfloat16 or float16, got {dtype!r}")
    return {
        "dtype": DTYPES[dtype], "max_batch_size": max_batch, "session_len": max_len,
        # the share of FREE memory for the KV cache; LMDeploy asserts 0 < x < 1
        "cache_max_entry_count": min(float(kv_cache_fraction), 0.95),
        # the model agent in this process: weight updates load into it (lmdeploy_weights.py says why)
        "distributed_executor_backend": "uni",
        "eager_mode": not cuda_graphs, "enable_prefix_caching": False,  # no stale prefix across weight updates
        "dllm_block_length": settings.block_size, "dllm_unmasking_strategy": settings.unmasking,
        "dllm_denoising_steps": settings.steps, "dllm_confidence_threshold": settings.threshold,
    }


def check_decoding(params: SamplingParams, settings: DLLMSettings) -> None:
    """FieldError for decoding LMDeploy's engine-wide settings cannot give this request."""
    strategy = Strategy(params.strategy)
    where = "LMDeploy's dLLM decoding is engine-wide"
    if strategy is not settings.strategy:
        raise FieldError("strategy", f"the lmdeploy backend decodes every request with {settings.strategy.value!r} "
                                     f"(server.default_strategy; {where}), got {strategy.value!r}")
    if strategy is Strategy.dynamic:
        if params.steps not in (None, settings.block_size):
            raise FieldError("steps", "the lmdeploy backend's dynamic decoding commits at least one token per "
                                      f"forward: leave steps unset (or {settings.block_size}), got {params.steps}")
        if float(params.threshold) != settings.threshold:
            raise FieldError("threshold", f"the lmdeploy backend decodes with threshold {settings.threshold} "
                                          f"(server.default_threshold; {where}), got {params.threshold}")
    elif (params.steps or settings.block_size) != settings.steps:
        raise FieldError("steps", f"the lmdeploy backend decodes with {settings.steps} steps per block "
                                  f"(server.lmdeploy_steps; {where}), got {params.steps or settings.block_size}")


def generation_kwargs(params: SamplingParams, settings: DLLMSettings, *, eos_ids: list[int],
                      mask_token_id: int) -> dict[str, object]:
    """Keyword arguments of `lmdeploy.GenerationConfig` for one sequence (FieldError naming the field)."""
    check_decoding(params, settings)
    if params.logit_bias:
        raise FieldError("logit_bias", "the lmdeploy backend cannot add a bias to the logits of each denoising "
                                       "forward (LMDeploy's GenerationConfig has no logit_bias): drop it, or serve "
                                       "with the native backend (server.backend=native)")
    temperature = float(params.temperature)
    if temperature > MAX_TEMPERATURE:
        raise FieldError("temperature", f"the lmdeploy backend accepts at most {MAX_TEMPERATURE:g} (LMDeploy's "
                                        f"limit), got {temperature:g}")
    stop_ids = None if params.ignore_eos else sorted(set(eos_ids) | set(params.stop_token_ids or []))
    return {
        "max_new_tokens": int(params.max_tokens),
        "do_sample": temperature >= GREEDY_BELOW,
        "temperature": temperature if temperature >= GREEDY_BELOW else 0.0,
        "top_k": int(params.top_k), "top_p": float(params.top_p),
        "random_seed": params.seed,
        "stop_token_ids": stop_ids or None, "ignore_eos": False,
        "bad_token_ids": [mask_token_id],
        "skip_special_tokens": False,  # dlrl detokenises itself (dllm.detokenize)
    }
