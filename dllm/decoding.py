"""Standalone block-diffusion decoding: the server engine's loop (scheduler -> runner -> post-process) without a server.

    outs = generate(model, [prompt_ids, ...], SamplingParams(max_tokens=32, temperature=0), tokenizer)
    outs[0].completion_ids, outs[0].text, outs[0].trace.steps, outs[0].trace.logprobs

    dec = Decoder(BlockRunner(model, max_batch=16, max_len=4096, num_pages=2048))
    seq = dec.runner.new_sequence(prompt_ids, params)
    dec.add([seq]); ended = dec.step()          # one engine step; dec.run() until every sequence ended

One loop for every caller: `Decoder.step` is `dllm.scheduler.Scheduler.schedule` -> `runner.run` ->
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
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from dllm.block_manager import CacheFull, KVBudget
from dllm.commit import transfer_schedule
from dllm.intake import check_fits
from dllm.model import SDARForCausalLM
from dllm.postprocess import Postprocessor, SeqOutput, StepOutput
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams
from dllm.scheduler import ScheduledBatch, Scheduler
from dllm.sequence import GenerationOutput, Sequence, to_output

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllm.full.model import FullAttentionLM

__all__ = ["BlockRunner", "CacheFull", "Decoder", "GenerationOutput", "KVBudget", "Postprocessor", "SamplingParams",
           "SeqOutput", "Sequence", "StepOutput", "StepRunner", "check_fits", "generate", "to_output",
           "transfer_schedule"]


class StepRunner(Protocol):
    """What the loop needs of a runner (dllm.runner.BlockRunner, dllm.full.runner.FullRunner)."""

    kv_budget: KVBudget  # the cache the scheduler's block manager accounts for

    def postprocessor(self) -> Postprocessor: ...

    def run(self, batch: ScheduledBatch[Sequence]) -> StepOutput: ...

    def release(self, seqs: abc.Sequence[Sequence]) -> None: ...


R = TypeVar("R", bound=StepRunner)


class Decoder(Generic[R]):
    """A runner driven by its own scheduler: the engine's step, standalone (generate, tests, benchmarks)."""

    def __init__(self, runner: R, version: int = 0) -> None:
        self.runner, self.version = runner, version
        self.scheduler: Scheduler[Sequence] = Scheduler(runner.kv_budget, runner.postprocessor())

    def add(self, seqs: Sequence | abc.Iterable[Sequence]) -> None:
        """Queue sequences (made by `runner.new_sequence`); admitted as soon as their pages are free."""
        for s in [seqs] if isinstance(seqs, Sequence) else seqs:
            self.scheduler.add(s)

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that ended in it."""
        batch = self.scheduler.schedule(version=self.version)
        self.runner.release(batch.left)
        if not batch.running:
            raise CacheFull(f"no sequence can run: {self.scheduler.num_waiting} waiting, "
                            f"{self.scheduler.free_pages} free KV pages")
        return self.scheduler.postprocess(batch, self.runner.run(batch))

    @property
    def num_tokens(self) -> int:
        """Completion tokens committed so far (the scheduler's post-processing counts them)."""
        return self.scheduler.post.num_tokens

    @property
    def is_done(self) -> bool:
        return self.scheduler.is_done

    def run(self) -> None:
        """Step until every added sequence ended; the runner then hears of the last ones to end (what it
        keeps of them dropped, as the next step's `batch.left` would)."""
        while not self.is_done:
            self.step()
        if self.scheduler.has_left:
            self.runner.release(self.scheduler.schedule(version=self.version).left)


def generate(model: SDARForCausalLM | FullAttentionLM, prompts_ids: list[list[int]],
             params: SamplingParams | list[SamplingParams], tokenizer: PreTrainedTokenizerBase | None = None,
             use_cache: bool = True, eos_ids: abc.Iterable[int] | None = None,
             cache_mode: str = "exact", prefix_sharing: bool = True) -> list[GenerationOutput]:
    """Decode all prompts together; returns one GenerationOutput per prompt, in order. A full-attention
    model (LLaDA, Dream) decodes with dllm.full.decoding.generate_full in `cache_mode` ("exact" / "prefix")."""
    if not isinstance(model, SDARForCausalLM):
        from dllm.full.decoding import generate_full

        return generate_full(model, prompts_ids, params, tokenizer, cache_mode=cache_mode, eos_ids=eos_ids)
    plist = params if isinstance(params, list) else [params] * len(prompts_ids)
    bs = model.config.block_size
    max_len = max(len(p) + q.max_tokens for p, q in zip(prompts_ids, plist)) + bs
    dec = Decoder(BlockRunner(model, max_batch=len(prompts_ids), max_len=max_len, eos_ids=eos_ids,
                              tokenizer=tokenizer, use_cache=use_cache, prefix_sharing=prefix_sharing))
    seqs = [dec.runner.new_sequence(p, q) for p, q in zip(prompts_ids, plist)]
    dec.add(seqs)
    dec.run()
    return [to_output(s) for s in seqs]
