"""The model runner: what the engine needs from an inference engine, and nothing more.

One engine step (server/engine/engine.py) is nano-vllm's / vLLM v1's shape, three layers down to the
model (Engine -> Runner -> the model's step):

    batch = scheduler.schedule(paused=False, version=v, now=t)   # dllm.scheduler.ScheduledBatch
    runner.release(batch.left)                      # sequences whose pages came back: drop what you keep
    out = runner.run(batch)                         # ONE forward -> dllm.postprocess.StepOutput
    ended = scheduler.postprocess(batch, out, now)  # stop ids / strings, max_tokens, finish reason

A runner only runs steps on its device; it owns no sequence, no policy and no account of slots or
pages (the scheduler's block manager, dllm.block_manager, holds those):

    runner.info                                     # RunnerInfo: what it supports (below)
    seq = runner.new_sequence(prompt_ids, params)   # validate (FieldError "<field>: ...") -> ServerSequence
    runner.kv_budget                                # KVBudget: slots, pages, tokens per page, prefix
                                                    # sharing (the scheduler admits against it)
    post = runner.postprocessor()                   # the model's stop rules (eos ids, max length), with
                                                    # a tokenizer of its own for the engine thread
    out = runner.run(batch)                         # one batched forward over batch.running, writing K/V
                                                    # through each sequence's page table (seq.block_table):
                                                    # per sequence its block (ids, steps, logprobs), ok
    runner.release(seqs)                            # sequences that left: drop per-sequence state (the
                                                    # engine's one call, batch.left)
    top = runner.top_logprobs(seq, k)               # a finished sequence's top-k logprobs per token
    runner.model / runner.tokenizer                 # the weights the receiver updates while paused;
                                                    # the tokenizer the HTTP handlers use

Runners: native block-causal (server.engine.backends.native: dllm's BlockRunner), full attention
(LLaDA / Dream: server.engine.backends.full_attention, slots only, no paged cache) and LMDeploy
in-process (server.engine.backends.lmdeploy_runner: generates whole sequences asynchronously, `run`
hands back the next block each stream completed; trace-free; unpaged: LMDeploy pages its own cache).
Callers read what a runner supports from `runner.info` (never by probing its attributes).
`Backend` is the old name of the Protocol.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from dllm.postprocess import Postprocessor, StepOutput
from dllm.sampling_params import SamplingParams
from server.engine.scheduler import KVBudget, ScheduledBatch
from server.engine.sequence import ServerSequence

if TYPE_CHECKING:  # torch too: the API processes read RunnerInfo without importing torch
    import torch
    from transformers import PreTrainedTokenizerBase  # no types to mypy: it does not follow transformers


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner supports, declared by it (read by the API, the weight receiver and /v1/models)."""

    family: str                   # "sdar" (block-causal), "llada" / "dream" (full attention)
    cache_mode: str | None = None  # full attention: "exact" | "prefix" (Fast-dLLM); None: block-causal, exact
    has_top_logprobs: bool = True  # OpenAI `logprobs`: per completion token, the top-k of its distribution
    has_likelihoods: bool = True   # prompt log-likelihoods (max_tokens 0, echo; dllm.likelihood: block-causal)
    prefix_sharing: bool = False   # complete prompt blocks shared across samples and requests (server.prefix_caching)
    weights: Literal["copy", "runner"] = "copy"  # an update is copied into `model` in place (copy_into_model),
    # or handed to the runner's own `apply_weights(named)` (lmdeploy)
    note: str = ""                 # why a capability is missing, when it is (logged, in the README)


@runtime_checkable
class Runner(Protocol):
    name: str
    block_size: int
    max_len: int        # longest prompt + completion a sequence may reach
    max_batch: int
    vocab_size: int
    mask_token_id: int

    @property
    def model(self) -> torch.nn.Module:
        """The served weights, with Hugging Face parameter names (the receiver copies updates into them)."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The server-side tokenizer (encode prompts, chat template); None: token ids only."""
        ...

    @property
    def info(self) -> RunnerInfo:
        """What this runner supports."""
        ...

    @property
    def kv_budget(self) -> KVBudget:
        """The cache the scheduler admits against."""
        ...

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> ServerSequence:
        """Validate and build a sequence; raise FieldError('<field>: <message>') on bad input."""
        ...

    def postprocessor(self) -> Postprocessor:
        """The model's stop rules for the scheduler (its own tokenizer instance: engine thread only)."""
        ...

    def run(self, batch: ScheduledBatch[ServerSequence]) -> StepOutput:
        """One batched forward over `batch.running` (K/V written through each sequence's page table);
        returns each sequence's outcome (no post-processing)."""
        ...

    def release(self, seqs: list[ServerSequence]) -> None:
        """Drop what the runner keeps of sequences that left the batch (finished, aborted, failed): their
        slots and pages are already back in the scheduler's block manager."""
        ...

    def top_logprobs(self, seq: ServerSequence, k: int) -> list[list[tuple[int, float]]]:
        """For every completion token of the finished `seq`: the k most likely (token id, logprob) of
        the distribution it was sampled from, best first (OpenAI logprobs). Called in the engine
        thread right after `seq` finished, while the weights it was generated with are served."""
        ...

    def close(self) -> None:
        """Free device resources."""
        ...


@runtime_checkable
class AppliesWeights(Protocol):
    """A runner with its own weight-update path (RunnerInfo.weights == "runner": lmdeploy)."""

    def apply_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A full set of HF-named tensors into the served model."""
        ...


Backend = Runner
