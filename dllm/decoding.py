"""Standalone block-diffusion decoding: the server engine's loop (scheduler -> runner -> post-process) without a server.

    outs = generate(model, [prompt_ids, ...], SamplingParams(max_tokens=32, temperature=0), tokenizer)
    outs[0].completion_ids, outs[0].text, outs[0].trace.steps, outs[0].trace.logprobs

    dec = Decoder(BlockRunner(model, max_batch=16, max_len=4096, num_pages=2048))
    seq = dec.runner.new_sequence(prompt_ids, params)
    dec.add([seq]); ended = dec.step()          # one engine step; dec.run() until every sequence ended

One loop for every caller (dllm.loop, re-exported here): `Decoder.step` is `dllm.scheduler.Scheduler.schedule` -> `runner.run` ->
`Scheduler.postprocess`, the very step the server's engine runs (server.engine.engine, with the
server's Scheduler on top of the same one). The scheduler admits what fits and owns every KV page
(dllm.block_manager: prefix sharing, optimistic growth, preemption); the runner (dllm.runner) runs the
forward; `dllm.postprocess.Postprocessor` applies stop ids, stop strings and max_tokens.

Blocks are aligned to absolute position 0. Per sequence: its complete prompt blocks go
into the cache (or are found there: prefix sharing); then per block, denoising forwards each
commit some masked tokens (`dllm.commit`: static, dynamic or sequential) until no mask is left;
the finished block's clean K/V are written by the sequence's next forward. A row whose
probabilities are not finite ends its own sequence (finish_reason "error", `seq.error` says why).
A full-attention model (LLaDA, Dream) decodes with dllm.full.decoding.generate_full: this `Decoder` over
`dllm.full.runner.FullRunner` (slots only, no pages), the same loop.
"""

from __future__ import annotations

from collections import abc
from typing import TYPE_CHECKING

from dllm.block_manager import CacheFull, KVBudget
from dllm.cache_mode import DEFAULT_CACHE_MODE
from dllm.intake import check_fits
from dllm.loop import Decoder, StepRunner, decode
from dllm.model import SDARForCausalLM
from dllm.postprocess import Postprocessor, SeqOutput, StepOutput
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams
from dllm.sequence import GenerationOutput, Sequence, to_output
from dllm.strategy import transfer_schedule

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllm.full.model import FullAttentionLM

__all__ = ["BlockRunner", "CacheFull", "Decoder", "GenerationOutput", "KVBudget", "Postprocessor", "SamplingParams",
           "SeqOutput", "Sequence", "StepOutput", "StepRunner", "check_fits", "decode", "generate", "to_output",
           "transfer_schedule"]


def generate(model: SDARForCausalLM | FullAttentionLM, prompts_ids: list[list[int]],
             params: SamplingParams | list[SamplingParams], tokenizer: PreTrainedTokenizerBase | None = None,
             use_cache: bool = True, eos_ids: abc.Iterable[int] | None = None,
             cache_mode: str = DEFAULT_CACHE_MODE, prefix_sharing: bool = True) -> list[GenerationOutput]:
    """Decode all prompts together; returns one GenerationOutput per prompt, in order. A full-attention
    model (LLaDA, Dream) decodes with dllm.full.runner.FullRunner in `cache_mode` ("exact" / "prefix"), the
    same loop (dllm.full.decoding.generate_full takes its other options)."""
    plist = params if isinstance(params, list) else [params] * len(prompts_ids)
    if not isinstance(model, SDARForCausalLM):
        from dllm.full.runner import FullRunner

        return decode(FullRunner.for_prompts(model, prompts_ids, plist, tokenizer=tokenizer, eos_ids=eos_ids,
                                             cache_mode=cache_mode), prompts_ids, plist)
    bs = model.config.block_size
    max_len = max(len(p) + q.max_tokens for p, q in zip(prompts_ids, plist)) + bs
    return decode(BlockRunner(model, max_batch=len(prompts_ids), max_len=max_len, eos_ids=eos_ids, tokenizer=tokenizer,
                              use_cache=use_cache, prefix_sharing=prefix_sharing), prompts_ids, plist)
