"""The engine's loop, standalone: a runner driven by its own scheduler (scheduler -> runner -> post-process).

    dec = Decoder(runner)                        # dllm.runner.BlockRunner or dllm.full.runner.FullRunner
    seq = dec.runner.new_sequence(prompt_ids, params)
    dec.add([seq]); ended = dec.step()          # one engine step; dec.run() until every sequence ended
    outs = decode(runner, prompts_ids, params)  # every prompt at once -> [GenerationOutput]

`Decoder.step` is `dllm.scheduler.Scheduler.schedule` -> `runner.release(batch.left)` -> `runner.run` ->
`Scheduler.postprocess`, the very step the server's engine runs (server.engine.engine, with the server's
Scheduler on top of the same one), for the block-causal and the full-attention runners alike: the scheduler's
block manager owns every slot and page, the scheduler writes every status and finish reason, the runner only
computes. `dllm.decoding.generate` and `dllm.full.decoding.generate_full` are `decode` over their runner.
"""

from __future__ import annotations

from collections import abc
from typing import Generic, Protocol, TypeVar

from dllm.block_manager import CacheFull, KVBudget
from dllm.postprocess import Postprocessor, StepOutput
from dllm.sampling import SamplingParams
from dllm.scheduler import ScheduledBatch, Scheduler
from dllm.sequence import GenerationOutput, Sequence, to_output


class StepRunner(Protocol):
    """What the loop needs of a runner (dllm.runner.BlockRunner, dllm.full.runner.FullRunner)."""

    kv_budget: KVBudget  # the cache the scheduler's block manager accounts for

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None) -> Sequence: ...

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


def decode(runner: R, prompts_ids: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
    """Every prompt through `runner`, driven by its own scheduler (`Decoder`) until all ended; one
    GenerationOutput per prompt, in order."""
    dec = Decoder(runner)
    seqs = [runner.new_sequence(p, q) for p, q in zip(prompts_ids, params, strict=True)]
    dec.add(seqs)
    dec.run()
    return [to_output(s) for s in seqs]
