"""Standalone decoding of full-attention diffusion LMs (LLaDA, Dream): the server engine's loop over the
full-attention runner.

    outs = generate_full(model, [prompt_ids, ...], SamplingParams(max_tokens=32), tok, cache_mode="exact")
    outs[0].completion_ids, outs[0].trace.steps, outs[0].trace.logprobs, outs[0].trace.cache_mode

    dec = Decoder(FullRunner(model, max_batch=16, max_len=4096, cache_mode="prefix"))   # step by step
    seq = dec.runner.new_sequence(prompt_ids, params); dec.add(seq); ended = dec.step()

One loop: `dllm.loop.Decoder` (dllm.decoding.Decoder) drives `dllm.full.runner.FullRunner` exactly as it drives the
block-causal runner (dllm.runner.BlockRunner) and as the server's engine drives both: the scheduler
(dllm.scheduler, its block manager handing out slots) -> `runner.run` -> the scheduler's
post-processing. The decoding semantics (the official rollouts' blocks, schedules, ranking, cache
modes) are the runner's: see dllm.full.runner.
"""

from __future__ import annotations

from collections import abc
from typing import TYPE_CHECKING

from dllm.cache_mode import CACHE_MODES, DEFAULT_CACHE_MODE
from dllm.full.model import FullAttentionLM
from dllm.full.runner import FullRunner, canvas_len
from dllm.full.schedule import AUTO_HORIZON
from dllm.loop import Decoder, decode
from dllm.sampling import SamplingParams
from dllm.sequence import GenerationOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CACHE_MODES", "Decoder", "FullRunner", "canvas_len", "generate_full"]


def generate_full(model: FullAttentionLM, prompts_ids: list[list[int]], params: SamplingParams | list[SamplingParams],
                  tokenizer: PreTrainedTokenizerBase | None = None, cache_mode: str = DEFAULT_CACHE_MODE,
                  eos_ids: abc.Iterable[int] | None = None, pad_penalty: float = 1.0,
                  further_horizon: int | None = AUTO_HORIZON, ranking: str = "official",
                  rng: str = "counter", compile: bool | str = False) -> list[GenerationOutput]:
    """Decode all prompts together; one GenerationOutput per prompt, in order (trace included)."""
    plist = params if isinstance(params, list) else [params] * len(prompts_ids)
    runner = FullRunner.for_prompts(model, prompts_ids, plist, tokenizer=tokenizer, cache_mode=cache_mode,
                                    eos_ids=eos_ids, pad_penalty=pad_penalty, further_horizon=further_horizon,
                                    ranking=ranking, rng=rng, compile=compile)
    return decode(runner, prompts_ids, plist)
