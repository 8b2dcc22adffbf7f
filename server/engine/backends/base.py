"""The model runner: what the engine needs from an inference engine, and nothing more.

One engine step (server/engine/engine.py) is nano-vllm's / vLLM v1's shape:

    batch = scheduler.schedule(paused=False, version=v, now=t)   # server.engine.scheduler.ScheduledBatch
    runner.release(batch.released)                  # aborted sequences: free their cache
    out = runner.run(batch)                         # ONE forward -> dllm.decoding.StepOutput
    ended = scheduler.postprocess(batch, out, now)  # stop ids / strings, max_tokens, finish reason
    runner.release(ended)

A runner only runs steps on its device; it owns no sequence and no policy:

    seq = runner.new_sequence(prompt_ids, params)   # validate (FieldError "<field>: ...") -> ServerSequence
    runner.kv_budget                                # KVBudget: slots, pages, tokens per page (the
                                                    # scheduler admits against it)
    post = runner.postprocessor()                   # the model's stop rules (eos ids, max length), with
                                                    # a tokenizer of its own for the engine thread
    out = runner.run(batch)                         # drop batch.preempted's cache (KVBudget.optimistic
                                                    # only: they keep tokens and trace), allocate
                                                    # batch.admitted's pages at seq.slot, then
                                                    # one batched forward over batch.running: per
                                                    # sequence its block (ids, steps, logprobs), ok
    runner.release(seqs)                            # free the cache of sequences that left
    top = runner.top_logprobs(seq, k)               # a finished sequence's top-k logprobs per token
    runner.model / runner.tokenizer                 # the weights the receiver updates while paused;
                                                    # the tokenizer the HTTP handlers use

The runners coming next fit the same Protocol:
- **full attention** (LLaDA, Dream): `kv_budget` with `num_pages=0` in exact mode (no block-causal
  KV reuse: each forward recomputes the whole sequence, slots bound only the batch), or the pages
  of its prefix cache in prefix-cache mode; `run` returns the same per-sequence blocks.
- **LMDeploy in-process** (server/engine/backends/lmdeploy_runner.py, built): LMDeploy generates
  whole sequences asynchronously, so `run` hands back, per running sequence, the next block its
  stream has completed (waiting at most a poll interval for one), with `steps`/`logprobs` zero and
  the trace marked trace-free (`Trace.trace_free`: random masking / coupled RL train from it, trace
  replay refuses it); `kv_budget` is unpaged (LMDeploy pages its own cache); it has
  `apply_weights(named)` (its own update path, which server.weights uses instead of copy_into_model)
  and `has_top_logprobs = False` (logprobs requests are a 400).

`server.engine.backends.native.NativeBackend` runs dllm's `BlockDecoder.run` (its `DecodeStep` and CUDA
graphs below it). `Backend` is the old name of the Protocol.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from dllm.decoding import StepOutput
from dllm.postprocess import Postprocessor
from dllm.sampling import SamplingParams
from server.engine.scheduler import KVBudget, ScheduledBatch
from server.engine.sequence import ServerSequence


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (missing package, no GPU, ...)."""


@runtime_checkable
class Runner(Protocol):
    name: str
    model: Any          # torch.nn.Module with SDAR parameter names (None for a fake)
    tokenizer: Any      # the server-side tokenizer (encode prompts, chat template)
    block_size: int
    max_len: int        # longest prompt + completion a sequence may reach
    max_batch: int
    vocab_size: int
    mask_token_id: int

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

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Allocate the admitted sequences' cache at their slots, then one batched forward over
        `batch.running`; returns each sequence's outcome (no post-processing)."""
        ...

    def release(self, seqs: list[ServerSequence]) -> None:
        """Free the cache of sequences that left the batch (finished, aborted, failed)."""
        ...

    def top_logprobs(self, seq: ServerSequence, k: int) -> list[list[tuple[int, float]]]:
        """For every completion token of the finished `seq`: the k most likely (token id, logprob) of
        the distribution it was sampled from, best first (OpenAI logprobs). Called in the engine
        thread right after `seq` finished, while the weights it was generated with are served."""
        ...

    def close(self) -> None:
        """Free device resources."""
        ...


Backend = Runner
