"""The lmdeploy backend: dlrl's server over an in-process LMDeploy PyTorch engine (SDAR / TraDo).

    runner = LMDeployRunner.from_pretrained("SDAR-1.7B-Chat", max_batch=32, strategy="dynamic",
                                            threshold=0.9, lmdeploy_steps=0)     # server.backend=lmdeploy

LMDeploy's engine is asynchronous and generates whole sequences: a request goes in as token ids
(`EngineInstance.async_stream_infer(session_id, input_ids, gen_config)`) and committed tokens
stream out, with its own scheduler, KV cache and CUDA graphs. The Runner Protocol
(server/engine/backends/base.py) wants one step at a time; the adapter is:

- the runner owns an asyncio loop thread where LMDeploy's engine loop and one consumer task per
  sequence run; `run(batch)` starts the admitted sequences there, waits (at most POLL_S) until
  some running sequence has a block's worth of new tokens (or ended), and hands back those
  blocks: a dlrl "step" is one completed block per ready sequence, not one denoising forward
  (`num_forwards` counts blocks; a step in which no block was ready within POLL_S hands back
  nothing, so step metrics count these polls too);
- dlrl's scheduler admits against slots only (`KVBudget(num_pages=0)`): LMDeploy pages its own
  KV cache and queues what does not fit;
- dlrl's post-processor still decides stop ids, stop strings, max_tokens and the finish reason
  (`LMDeployPostprocessor`; a stream that ended inside a block ends the sequence with the rest);
  a sequence that left (finished, aborted) is cancelled in LMDeploy by `release`; a request LMDeploy
  ended otherwise than with FINISH -- a CANCEL dlrl did not ask for (LMDeploy cancels every request
  while asleep), an error status, a stream that stopped without a final status -- ends its sequence
  with finish reason "error" and the cause (the server answers 500), never as a normal end;
- traces: LMDeploy reports no per-token denoising step, and its log-probabilities are per
  forward over all block candidates, not the final tokens'. Its unmasking hook
  (`DLLMModelAgentStrategy.unmasking_processor`, replaceable without patching files) sees the
  batched dllm masks without session ids or the sampling distribution, so a step map recorded
  there could not be tied to requests reliably across LMDeploy versions. Every sequence is
  therefore **trace-free** (`Trace.trace_free`, steps / logprobs 0): evaluation, serving and the
  random-masking / coupled objectives use it; trace replay refuses it (trainer.loop). Top
  logprobs (OpenAI `logprobs`) and prompt likelihoods are refused (400) for the same reason.

Weights: `model` is a host copy of the served weights (dlrl's SDAR module, HF names, the
served dtype): the weight-sync receiver validates, digests and keeps versions against it, and
`apply_weights` (the receiver's apply, and rollback's) pushes a full set of tensors into LMDeploy's
model agent in this process (LMDeploy runs its 'uni' executor, `distributed_executor_backend="uni"`)
in DiRL's order -- sleep level 2 -> wake weights -> the agent's update_params per FlattenedTensorBucket
-> wake KV cache, always -- then copies them into the host copy; a failure half-way pushes the served
weights back (server/engine/backends/lmdeploy_weights.py says why this path and not Engine.update_params).
If the push-back fails too, every request fails with that error until a full push succeeds. It costs
one host copy of the weights.

`close` lets LMDeploy's main task clean up: the consumers are cancelled, then
`engine.close()` cancels the main task and `engine.wait_tasks()` waits (at most CLOSE_TIMEOUT_S) for its
cleanup -- the engine loop stopped, `executor.release()` (the model and KV cache's GPU memory) -- before the
runner's loop stops, so a second engine in the same process finds the memory free.

lmdeploy is imported lazily (`load_lmdeploy`, server/engine/backends/lmdeploy_engine.py, with the loop
thread): missing, older than 0.13 (async sleep, requests cancelled while asleep), or no CUDA device, is
BackendUnavailable naming `server.backend` (LMDeploy's PyTorch engine has no CPU device). Tests drive the runner
with a double of LMDeploy's engine interface (`engine` and `api` are injected).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dllm.decoding import SeqOutput, StepOutput, check_fits
from dllm.errors import FieldError
from dllm.postprocess import Postprocessor
from dllm.sampling import SamplingParams
from dllm.sequence import Sequence
from dllm.trace import FinishReason
from server.engine.backends.base import RunnerInfo
from server.engine.backends.lmdeploy_engine import (
    FULL_ATTENTION_DEFAULTS,
    LMDeployAPI,
    LMDeployEngine,
    LMDeployInstance,
    LoopThread,
    check_options,
    lmdeploy_api,
    load_lmdeploy,
)
from server.engine.backends.lmdeploy_params import DLLMSettings, engine_kwargs, generation_kwargs
from server.engine.backends.lmdeploy_weights import LMDeployBroken, apply_full, in_process_agent, push
from server.engine.scheduler import KVBudget, ScheduledBatch
from server.engine.sequence import ServerSequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # no types to mypy: it does not follow transformers

    from dllm.weights import DiffusionLM

log = logging.getLogger("dlrl.server")
POLL_S = 0.05  # longest `run` waits for a block before handing control back (aborts, admissions)
CLOSE_TIMEOUT_S = 30.0  # longest close waits for LMDeploy's main task to release its executor
DEFAULT_MAX_LEN = 8192
_sessions = itertools.count(1)


@dataclass
class _Stream:
    """One sequence's LMDeploy request, as its consumer task fills it (guarded by the runner's lock)."""

    session_id: int
    tokens: list[int] = field(default_factory=list)  # received, not yet handed to the scheduler
    done: bool = False
    error: str | None = None
    cancelled: bool = False  # dlrl cancelled it (`release`, `close`): LMDeploy's CANCEL is then its end
    future: concurrent.futures.Future[None] | None = None
    task: asyncio.Task[None] | None = None  # its consumer, on the loop


class LMDeployPostprocessor(Postprocessor):
    """dlrl's stop rules, plus: a sequence whose LMDeploy stream ended (all its tokens handed over)
    ends here too -- "length" at max_tokens, "stop" otherwise, "error" if LMDeploy failed."""

    def __init__(self, *, ended: Callable[[Sequence], tuple[bool, str | None]], eos_ids: Iterable[int],
                 tokenizer: PreTrainedTokenizerBase | None, max_len: int, block_size: int) -> None:
        super().__init__(eos_ids=eos_ids, tokenizer=tokenizer, max_len=max_len, block_size=block_size)
        self.ended = ended

    def commit_block(self, s: Sequence) -> FinishReason | None:
        reason = super().commit_block(s)
        if reason is not None:
            return reason
        drained, error = self.ended(s)
        if error is not None:
            s.error = error
            return FinishReason.ERROR
        if drained:
            return FinishReason.LENGTH if len(s.completion_ids) >= s.params.max_tokens else FinishReason.STOP
        return None


class LMDeployRunner:
    """The Runner (server.engine.backends.base) over an LMDeploy PyTorch engine; see the module docstring."""

    name = "lmdeploy"
    # trace-free: `logprobs` and prompt likelihoods are refused (400). server.prefix_caching is not mapped to
    # LMDeploy's own (PytorchEngineConfig.enable_prefix_caching, left off): it has not run with its dLLM mode
    # (an update's sleep level 2 releases its KV cache, so no page of older weights would survive a push).
    info = RunnerInfo("sdar", has_top_logprobs=False, has_likelihoods=False, prefix_sharing=False, weights="runner",
                      note="trace-free; LMDeploy's own prefix caching is not turned on (not run with its dLLM mode)")

    def __init__(self, engine: LMDeployEngine, api: LMDeployAPI, model: DiffusionLM,
                 tokenizer: PreTrainedTokenizerBase | None, *, settings: DLLMSettings,
                 eos_ids: list[int], max_batch: int, max_len: int, device: str = "cuda",
                 update_bucket_bytes: int = 256 << 20) -> None:
        cfg = model.config
        self.engine, self.api, self.model, self.tokenizer = engine, api, model, tokenizer
        self.settings, self.eos_ids = settings, sorted(set(eos_ids))
        self.block_size, self.vocab_size, self.mask_token_id = settings.block_size, cfg.vocab_size, cfg.mask_token_id
        self.max_batch, self.max_len, self.device = max_batch, max_len, device
        self.update_bucket_bytes = update_bucket_bytes
        self._agent = in_process_agent(engine)  # where apply_weights loads (BackendUnavailable: not here)
        self._cond = threading.Condition()
        self._streams: dict[int, _Stream] = {}  # seq_id -> its LMDeploy request
        self._broken: str | None = None  # LMDeploy holds no consistent weights: every request fails with it
        self._loop = LoopThread()
        self._closed = False
        self._loop.call(self._start_engine)
        self._instances = [self._loop.call(engine.create_instance) for _ in range(max_batch)]
        log.info("%s", settings.describe())

    def _start_engine(self) -> None:
        start = getattr(self.engine, "start_loop", None)
        if start is not None:
            start()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "auto", max_batch: int = 16, max_model_len: int = 0,
                        trust_remote_code: bool = False, block_size: int = 0, mask_token_id: int = -1,
                        kv_cache_fraction: float = 0.8, cuda_graphs: bool = False, strategy: str = "dynamic",
                        threshold: float = 0.9, lmdeploy_steps: int = 0, device: str = "auto",
                        kv_cache_memory: int = 0, compile: bool = False, kv_admission: str = "reserve",
                        **others: object) -> LMDeployRunner:
        """Check the options, lmdeploy and CUDA, load the host copy and dlrl's tokenizer, build LMDeploy's engine."""
        full = {k: others[k] for k in FULL_ATTENTION_DEFAULTS if k in others}
        check_options(device=device, kv_cache_memory=kv_cache_memory, compile=compile, kv_admission=kv_admission,
                      **full)
        lmdeploy = load_lmdeploy()
        from lmdeploy.pytorch.engine import Engine as PytorchEngine

        from dllm.tokenizer import eos_token_ids, load_tokenizer
        from dllm.weights import load_pretrained, parse_dtype

        host_dtype = torch.bfloat16 if dtype in ("auto", "") else parse_dtype(dtype)
        model = load_pretrained(path, device="cpu", dtype=host_dtype, block_size=block_size or None,
                                mask_token_id=None if mask_token_id < 0 else mask_token_id)
        cfg = model.config
        settings = DLLMSettings.from_server(block_size=cfg.block_size, strategy=strategy, steps=lmdeploy_steps,
                                            threshold=threshold)
        max_len = max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_LEN)
        kwargs = engine_kwargs(settings, max_batch=max_batch, max_len=max_len, dtype=dtype,
                               kv_cache_fraction=kv_cache_fraction, cuda_graphs=cuda_graphs)
        engine = PytorchEngine.from_pretrained(str(path), engine_config=lmdeploy.PytorchEngineConfig(**kwargs),
                                               trust_remote_code=trust_remote_code)
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        eos = eos_token_ids(path, tokenizer, cfg.eos_ids)
        log.info("lmdeploy %s engine for %s (host copy %s); stop ids %s", lmdeploy.__version__, path, host_dtype, eos)
        return cls(engine, lmdeploy_api(), model, tokenizer, settings=settings, eos_ids=eos, max_batch=max_batch,
                   max_len=max_len)

    # ------------------------------------------------------------------ sequences
    def new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> ServerSequence:
        check_fits(len(prompt_ids), params.max_tokens, self.max_len)
        params.validate(self.block_size)
        for t in prompt_ids:
            if not 0 <= t < self.vocab_size or t == self.mask_token_id:
                raise FieldError("prompt_ids", f"invalid token id {t} (vocab {self.vocab_size}, mask id "
                                               f"{self.mask_token_id})")
        self.gen_config(params)  # FieldError (-> 400) for what LMDeploy cannot honour, before queueing
        if params.stop_token_ids is not None and not params.ignore_eos:  # as the native backend: added to eos
            params.stop_token_ids = sorted(set(self.eos_ids) | set(params.stop_token_ids))
        seq = ServerSequence(prompt_ids, params, self.block_size, self.mask_token_id)
        seq.trace.trace_free, seq.trace.backend = True, self.name
        return seq

    def gen_config(self, params: SamplingParams) -> object:  # lmdeploy.GenerationConfig
        return self.api.generation_config(**generation_kwargs(params, self.settings, eos_ids=self.eos_ids,
                                                              mask_token_id=self.mask_token_id))

    @property
    def kv_budget(self) -> KVBudget:
        return KVBudget(self.max_batch)  # unpaged: LMDeploy pages (and queues for) its own KV cache

    def postprocessor(self) -> Postprocessor:
        tok = copy.deepcopy(self.tokenizer) if self.tokenizer is not None else None
        return LMDeployPostprocessor(ended=self._ended, eos_ids=self.eos_ids, tokenizer=tok, max_len=self.max_len,
                                     block_size=self.block_size)

    def _ended(self, seq: Sequence) -> tuple[bool, str | None]:
        """(its stream ended and every token was handed over, LMDeploy's error)."""
        with self._cond:
            stream = self._streams.get(seq.seq_id)
            if stream is None:
                return True, None
            return stream.done and not stream.tokens, stream.error

    # ------------------------------------------------------------------ steps
    def run(self, batch: ScheduledBatch) -> StepOutput:
        for seq in batch.admitted:
            self._start(seq)
        with self._cond:
            self._cond.wait_for(lambda: any(self._ready(s) for s in batch.running), POLL_S)
        outputs, num = [], 0
        for seq in batch.running:
            num += self._advance(seq)
            outputs.append(SeqOutput(seq, True))
        return StepOutput(outputs, num)

    def _start(self, seq: ServerSequence) -> None:
        stream = _Stream(next(_sessions))
        with self._cond:
            self._streams[seq.seq_id] = stream
            if self._broken is not None:
                stream.done, stream.error = True, f"lmdeploy engine: not serving: {self._broken}"
                return
        instance = self._instances[seq.slot or 0]
        stream.future = self._loop.spawn(self._consume(instance, stream, list(seq.prompt_ids),
                                                       self.gen_config(seq.params)))

    async def _consume(self, instance: LMDeployInstance, stream: _Stream, prompt_ids: list[int],
                       gen_config: object) -> None:
        """Read one LMDeploy request's outputs into its stream (on the loop thread). Only FINISH, or a CANCEL
        dlrl asked for, ends it normally; anything else is the sequence's error."""
        stream.task = asyncio.current_task()
        error: str | None = None
        final = False  # LMDeploy sent its last status (its stream then ends: it is read to the end)
        try:
            async for out in instance.async_stream_infer(stream.session_id, prompt_ids, gen_config=gen_config):
                status = getattr(out.status, "name", str(out.status))
                if final:
                    continue
                final = status != "SUCCESS"
                if status in ("SUCCESS", "FINISH"):
                    with self._cond:
                        stream.tokens += list(out.token_ids)
                        self._cond.notify_all()
                elif status == "CANCEL":
                    if not stream.cancelled:
                        error = ("lmdeploy engine: LMDeploy cancelled the request (its engine is asleep for a weight "
                                 "update, or stopping)")
                else:
                    error = f"lmdeploy engine: request failed ({status})"
            if not final and not stream.cancelled:
                error = "lmdeploy engine: the request's stream ended without FINISH"
        except Exception as e:
            error = f"lmdeploy engine: {type(e).__name__}: {e}"
        finally:
            with self._cond:
                stream.done, stream.error = True, error
                self._cond.notify_all()

    def _ready(self, seq: Sequence) -> bool:
        """(lock held) The sequence can be handed a block now."""
        stream = self._streams.get(seq.seq_id)
        if stream is None:
            return False
        need = self.block_size if seq.block_done else len(seq.masked_positions())
        return stream.done or len(stream.tokens) >= need

    def _advance(self, seq: ServerSequence) -> int:
        """Fill the sequence's block with its next tokens (fewer when its stream ended); the tokens placed."""
        with self._cond:
            if not self._ready(seq):
                return 0
            if seq.block_done:
                seq.next_block(owe_cache=False)
            stream = self._streams[seq.seq_id]
            need = len(seq.masked_positions())
            take, stream.tokens = stream.tokens[:need], stream.tokens[need:]
        ids = seq.block_ids[:self.block_size - need] + take  # shorter than a block when the stream ended
        seq.block_ids, seq.block_steps, seq.block_logprobs = ids, [0] * len(ids), [0.0] * len(ids)
        seq.block_done = True
        seq.num_forwards += 1
        return len(take)

    def release(self, seqs: list[ServerSequence]) -> None:
        for seq in seqs:
            with self._cond:
                stream = self._streams.pop(seq.seq_id, None)
                if stream is not None:
                    stream.cancelled = True
            if stream is not None and not stream.done:
                self._loop.spawn(self._cancel(self._instances[seq.slot or 0], stream))

    async def _cancel(self, instance: LMDeployInstance, stream: _Stream) -> None:
        try:
            await instance.async_cancel(stream.session_id)
        except Exception as e:  # already gone: nothing to stop
            log.debug("lmdeploy cancel of session %d: %r", stream.session_id, e)
        if stream.future is not None:
            stream.future.cancel()

    def top_logprobs(self, seq: ServerSequence, k: int) -> list[list[tuple[int, float]]]:
        raise FieldError("logprobs", "the lmdeploy backend returns no log-probabilities aligned to the tokens")

    # ------------------------------------------------------------------ weights
    def apply_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A full set of HF-named tensors -> LMDeploy, then the host copy (server/engine/backends/lmdeploy_weights.py).
        If LMDeploy is left without consistent weights (LMDeployBroken), requests fail until one succeeds."""
        try:
            apply_full(self.model, named, self._push)
        except LMDeployBroken as e:
            with self._cond:
                self._broken = str(e)
            raise
        with self._cond:
            self._broken = None

    def _push(self, named: list[tuple[str, torch.Tensor]]) -> int:
        return push(self._loop, self.engine, self._agent, self.api, named, dtype=self.model.dtype, device=self.device,
                    bucket_bytes=self.update_bucket_bytes)

    def close(self) -> None:
        if self._closed:  # the server's shutdown and a caller's may both close it
            return
        self._closed = True
        with self._cond:
            streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream.cancelled = True
        for stream in streams:  # one not started yet never starts
            if stream.future is not None:
                stream.future.cancel()
        try:
            self._loop.run(self._shutdown(streams), CLOSE_TIMEOUT_S * 2 + 5)
        except Exception as e:
            log.warning("lmdeploy engine did not shut down cleanly: %r", e)
        finally:
            self._loop.close()

    async def _shutdown(self, streams: list[_Stream]) -> None:
        """(on the loop) Consumers cancelled and awaited, then LMDeploy's main task cancelled and awaited: its
        cleanup stops the engine loop and releases the executor (GPU memory)."""
        tasks = [s.task for s in streams if s.task is not None and not s.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
        self.engine.close()
        try:
            await asyncio.wait_for(self.engine.wait_tasks(), CLOSE_TIMEOUT_S)
        except asyncio.CancelledError:  # its main task ended cancelled: the expected end
            pass
        except TimeoutError:
            log.warning("lmdeploy engine: its main task did not finish within %.0f s of close; its GPU memory may "
                        "still be held", CLOSE_TIMEOUT_S)
