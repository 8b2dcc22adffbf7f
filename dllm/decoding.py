"""Block-diffusion decoding with a paged KV cache and exact traces: one batched step for all sequences.

    outs = generate(model, [prompt_ids, ...], SamplingParams(max_tokens=32, temperature=0), tokenizer)
    outs[0].completion_ids, outs[0].text, outs[0].trace.steps, outs[0].trace.logprobs

    dec = BlockDecoder(model, max_batch=16, max_len=4096, tokenizer=tok, num_pages=2048)
    seq = dec.new_sequence(prompt_ids, params)
    dec.add([seq]) if dec.num_admissible([seq]) else ...; finished = dec.step(running)   # standalone
    out = dec.run(running); finished = Postprocessor(...)(out.outputs)  # the split the server uses

`run` is the device step alone (the server's runner, server/engine/backends/native.py, calls it; its
scheduler accounts for slots and pages, and post-processes with `dllm.postprocess`); `step`
is `run` + post-processing + release, for standalone decoding (`generate`, tests).

Blocks are aligned to absolute position 0. Per sequence: its complete prompt blocks go
into the cache; then per block, denoising forwards each commit some masked tokens
(`dllm.commit`: static, dynamic or sequential) until no mask is left; the finished block's
clean K/V are written by the sequence's next forward, as one more row of it (so are
one-block prompts; longer prompts get a cache-filling forward of their own). `run` runs ONE
denoising forward for every running sequence, each at its own position with its own
parameters, as the static decode step (`dllm.step`: rows and keys padded to buckets,
sampling and the commit rules as tensor ops on the device, optionally torch.compile'd or
replayed as CUDA graphs: `compile=`, `static_shapes=`, `cuda_graphs=`, `attention=`); the inputs go to the device in one
copy, and one small device-to-host copy per forward brings back each row's block (ids, steps,
logprobs) and whether its probabilities were finite. A row whose probabilities are not
finite ends its own sequence (finish_reason "error", `seq.error` says why); the others go
on untouched. Completed blocks are detokenised incrementally and checked against stop ids,
stop strings and max_tokens by `dllm.postprocess.Postprocessor`.

KV memory is paged (`dllm.kv_cache`, pages of block_size tokens): a sequence takes, when
added, the pages of its own prompt + max_tokens; `num_admissible` says how many waiting
sequences fit now (free slots and pages). With `optimistic=True` a sequence takes only the pages
its next forward touches and grows block by block (`num_pages_short` says how many pages the next
step lacks); the caller makes room with `preempt(seq)`: its slot and pages go back, and it keeps
its committed tokens, steps and current block, so when added again its clean prefix is written
back into the cache by one cache-filling forward (recompute, as vLLM's preemption) and it goes on
exactly where it stopped: same tokens and trace (the noise is keyed by seed, position and step).
"""

from __future__ import annotations

from collections import abc
from typing import TYPE_CHECKING

import numpy as np
import torch

from dllm.attention import MaskSpec
from dllm.commit import transfer_schedule
from dllm.intake import Intake, check_fits
from dllm.kv_cache import CacheFull, KVCache
from dllm.model import SDARForCausalLM
from dllm.postprocess import Postprocessor, SeqOutput, StepOutput, apply_step
from dllm.sampling import SamplingParams, counter_uniforms, needs_filter
from dllm.sequence import GenerationOutput, Sequence, step_inputs, to_output
from dllm.step import DecodeStep, columns, padding_row, sample_and_commit
from dllm.trace import FinishReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllm.full.model import FullAttentionLM

__all__ = ["BlockDecoder", "Postprocessor", "SeqOutput", "StepOutput", "CacheFull", "GenerationOutput", "Sequence", "check_fits", "generate", "to_output",
           "transfer_schedule"]


class BlockDecoder(Intake):
    """Batched block decoding over a block-paged KV cache (one slot + its own pages per sequence)."""

    def __init__(self, model: SDARForCausalLM, *, max_batch: int, max_len: int,
                 eos_ids: abc.Iterable[int] | None = None, tokenizer: PreTrainedTokenizerBase | None = None, use_cache: bool = True, num_pages: int | None = None, compile: bool | str = False,
                 cuda_graphs: bool = False, static_shapes: bool = True, attention: str = "auto",
                 optimistic: bool = False) -> None:
        cfg = model.config
        self.model, self.tokenizer, self.use_cache = model, tokenizer, use_cache
        self.vocab_size, self.block_size, self.mask_id = cfg.vocab_size, cfg.block_size, cfg.mask_token_id
        self.eos_ids = list(cfg.eos_ids if eos_ids is None else eos_ids)
        self.max_len = (max_len + self.block_size - 1) // self.block_size * self.block_size
        self.postprocess = Postprocessor(eos_ids=self.eos_ids, tokenizer=tokenizer, max_len=self.max_len,
                                         block_size=self.block_size)  # for `step` (standalone decoding)
        pages = max_batch * (self.max_len // self.block_size) if num_pages is None else num_pages
        self.cache = (KVCache(cfg, max_batch, self.max_len, model.device, model.dtype, num_pages=pages)
                      if use_cache else None)
        self.decode = (DecodeStep(model, self.cache, max_rows=2 * max_batch, compile=compile, cuda_graphs=cuda_graphs,
                                  static_shapes=static_shapes, attention=attention, max_sampled=max_batch)
                       if use_cache else None)
        self._clean_row = padding_row(self.block_size, self.mask_id)  # a clean row owed to the cache: writes
        self._clean_row[columns(self.block_size)["write"]] = 1.0
        self.free_slots = list(range(max_batch))[::-1]
        self.optimistic = optimistic and use_cache
        self.num_preempted = 0
        self.num_forwards = 0  # denoising forwards
        self.num_fill_forwards = 0  # cache-filling forwards of their own (prompts longer than a block)

    def num_pages_needed(self, seq: Sequence) -> int:
        """KV pages the sequence is given when added: its prompt + max_tokens, in blocks (optimistic: the
        pages its next forward touches)."""
        if not self.use_cache:
            return 0
        return -(-self._tokens_needed(seq) // self.block_size)

    def _tokens_needed(self, seq: Sequence) -> int:
        if not self.optimistic:
            return len(seq.prompt_ids) + seq.params.max_tokens
        return seq.end_pos + (self.block_size if seq.block_done else 0)  # its next forward's block end

    def num_pages_short(self, seqs: abc.Sequence[Sequence]) -> int:
        """Pages the next step of these (running) sequences lacks (optimistic: 0 = it can run)."""
        if self.cache is None:
            return 0
        grow = sum(max(0, self.cache.pages_for(min(self._tokens_needed(s), self.max_len))
                       - len(self.cache.slot_pages[s.slot])) for s in seqs if s.slot is not None)
        return max(0, grow - self.cache.num_free_pages)

    def preempt(self, seq: Sequence) -> None:
        """Take back a running sequence's slot and KV pages; it keeps its tokens, trace and block (add it
        again to go on: its clean prefix is recomputed into the cache first)."""
        if seq.slot is None:
            raise ValueError("preempt: the sequence holds no slot")
        if self.cache is not None:
            self.cache.free(seq.slot)
        self.free_slots.append(seq.slot)
        seq.slot, seq.pending, seq.preempted = None, None, True
        self.num_preempted += 1

    def num_admissible(self, seqs: abc.Sequence[Sequence]) -> int:
        """How many of `seqs`, taken in order, can be added now (free slots and free KV pages)."""
        num, pages = 0, self.cache.num_free_pages if self.cache is not None else 0  # None: use_cache=False
        for s in seqs:
            need = self.num_pages_needed(s)
            if num == len(self.free_slots) or need > pages:
                break
            num, pages = num + 1, pages - need
        return num

    def add(self, seqs: Sequence | abc.Sequence[Sequence]) -> None:
        """Give the new sequences slots and pages; their complete prompt blocks are prefilled by the next step."""
        seqs = [seqs] if isinstance(seqs, Sequence) else list(seqs)
        if self.num_admissible(seqs) < len(seqs):
            raise CacheFull(f"cannot add {len(seqs)} sequences: {len(self.free_slots)} free slots, "
                            f"{self.cache.num_free_pages if self.cache else 0} free KV pages")
        for s in seqs:
            if s.slot is None:
                s.slot = self.free_slots.pop()
            else:  # a slot its caller accounts for (server.engine.scheduler): this pool mirrors it
                self.free_slots.remove(s.slot)
            if s.preempted:  # back after a preemption: the cache refilled from its clean prefix
                if s.block_done:
                    s.next_block(owe_cache=False)
                s.preempted = False
                clean = (s.prompt_ids + s.completion_ids)[:s.block_start]
                s.pending = clean if self.use_cache and clean else None
            elif self.use_cache and s.block_start > 0:
                s.pending = s.prompt_ids[:s.block_start]  # prefilled with (or just before) the next step
            if self.cache is not None:
                self.cache.allocate(s.slot, self._tokens_needed(s))

    def release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            if self.cache is not None:
                self.cache.free(seq.slot)
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq.finish_reason is None:
            seq.finish_reason = FinishReason.ABORT

    def _logits_no_cache(self, seqs: abc.Sequence[Sequence]) -> torch.Tensor:
        """Baseline without a cache: recompute the whole prefix every forward -> logits [N, B, V]."""
        dev, B = self.model.device, self.block_size
        L = max(s.end_pos for s in seqs)
        ids = torch.full((len(seqs), L), self.mask_id, dtype=torch.long)
        valid = torch.zeros(len(seqs), L, dtype=torch.bool)
        for r, s in enumerate(seqs):
            full = (s.prompt_ids + s.completion_ids + s.trace.tail_ids)[:s.block_start] + s.block_ids
            ids[r, :len(full)] = torch.tensor(full)
            valid[r, :len(full)] = True
        pos = torch.arange(L, device=dev).expand(len(seqs), L)
        spec = MaskSpec(pos, pos, B, k_valid=valid.to(dev))
        hidden = self.model.hidden_states(ids.to(dev), spec)  # [N, L, D]: the whole prefix again
        idx = torch.stack([torch.arange(s.block_start, s.end_pos) for s in seqs]).to(dev)
        return self.model.lm_head(hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1])))

    @torch.no_grad()
    def run(self, seqs: abc.Sequence[Sequence]) -> StepOutput:
        """One denoising forward for every sequence (the device step; no post-processing): a sequence
        whose block completed last time moves on to its next block first. Returns per sequence its
        block after the forward (committed ids, steps, logprobs), whether its probabilities were
        finite and whether the block is complete (`seq.block_done`: for `Postprocessor`)."""
        if not seqs:
            return StepOutput([], 0)
        for s in seqs:
            if s.block_done:
                s.next_block(owe_cache=self.use_cache)
            if self.optimistic and self.cache is not None and s.slot is not None:
                self.cache.allocate(s.slot, s.end_pos)  # the block's pages (CacheFull: preempt first)
        before = sum(len(s.masked_positions()) for s in seqs)
        B, N = self.block_size, len(seqs)
        # clean blocks owed to the cache (a just-finished block, a one-block prompt) ride along with this
        # forward as extra rows; longer prompts get a cache-filling forward of their own first
        long = [s for s in seqs if s.pending is not None and len(s.pending) > B]
        if long:
            self._write_pending(long)
        rows = self._pack(seqs)  # [N + P, width(B)]
        filtered = any(needs_filter(s.params) for s in seqs)
        if self.decode is not None:  # use_cache
            out = self.decode.run(rows, N, max(s.end_pos for s in seqs), filtered)
        else:
            rows_t = torch.from_numpy(rows[:N]).to(self.model.device)
            out = sample_and_commit(self._logits_no_cache(seqs), rows_t, self.mask_id, filtered)
        self.num_forwards += 1
        for s in seqs:
            s.pending = None
        return apply_step(seqs, out.cpu(), B, self.mask_id, before)  # the one device-to-host copy

    def step(self, seqs: list[Sequence]) -> list[Sequence]:
        """Standalone decoding (`generate`, tests): `run`, post-process, release the sequences that
        ended; returns them (failed ones first). The server splits these (server.engine.scheduler)."""
        finished = self.postprocess(self.run(seqs).outputs)
        for s in finished:
            self.release(s)
        return finished

    def _pack(self, seqs: abc.Sequence[Sequence]) -> np.ndarray:
        """Every input of a step in one float64 array (dllm.step's row layout, one host-to-device copy):
        a row per sequence (its block, step fields, sampling parameters and uniforms), then a row per
        clean block owed to the cache (write only: its outputs are not read)."""
        B = self.block_size
        rows = np.array([step_inputs(s) for s in seqs], dtype=np.float64)  # [N, 3B + F]
        col = columns(B)
        noise = counter_uniforms([s.seed for s in seqs], rows[:, col["block_start"], None] + np.arange(B),
                                 rows[:, col["step"]])
        rows = np.concatenate([rows, noise], axis=1)  # [N, width(B)]
        owed = [s for s in seqs if s.pending is not None]
        if not owed or not self.use_cache:
            return rows
        clean = np.tile(self._clean_row, (len(owed), 1))
        clean[:, :B] = [s.pending for s in owed]
        clean[:, col["block_start"]] = [s.block_start - B for s in owed]
        clean[:, col["slot"]] = [s.slot for s in owed]
        return np.concatenate([rows, clean])

    def _write_pending(self, seqs: list[Sequence]) -> None:
        """One cache-filling forward (no logits) for prompts of more than one block (one row each)."""
        pending = [p for s in seqs if (p := s.pending) is not None]
        assert len(pending) == len(seqs), "_write_pending: every sequence owes clean ids"
        L = max(len(p) for p in pending)
        ids = torch.full((len(seqs), L), self.mask_id, dtype=torch.long)
        valid = torch.zeros(len(seqs), L, dtype=torch.bool)  # padding writes into the scratch page
        for r, p in enumerate(pending):
            ids[r, :len(p)] = torch.tensor(p)
            valid[r, :len(p)] = True
        starts = torch.tensor([s.block_start - len(p) for s, p in zip(seqs, pending)])
        dev = self.model.device
        pos = (starts.to(dev)[:, None] + torch.arange(L, device=dev)).clamp_(max=self.max_len - 1)  # [N, L]
        kv_len = min(self.max_len, max(s.block_start - len(p) for s, p in zip(seqs, pending)) + L)
        self.model(ids.to(dev), pos, cache=self.cache, slots=torch.tensor([s.slot for s in seqs]).to(dev),
                   kv_len=kv_len, write_mask=valid.to(dev), num_logits=0)
        self.num_fill_forwards += 1
        for s in seqs:
            s.pending = None


def generate(model: SDARForCausalLM | FullAttentionLM, prompts_ids: list[list[int]],
             params: SamplingParams | list[SamplingParams], tokenizer: PreTrainedTokenizerBase | None = None,
             use_cache: bool = True, eos_ids: abc.Iterable[int] | None = None,
             cache_mode: str = "exact") -> list[GenerationOutput]:
    """Decode all prompts together; returns one GenerationOutput per prompt, in order. A full-attention
    model (LLaDA, Dream) decodes with dllm.full.decoding.generate_full in `cache_mode` ("exact" / "prefix")."""
    if not isinstance(model, SDARForCausalLM):
        from dllm.full.decoding import generate_full

        return generate_full(model, prompts_ids, params, tokenizer, cache_mode=cache_mode, eos_ids=eos_ids)
    plist = params if isinstance(params, list) else [params] * len(prompts_ids)
    bs = model.config.block_size
    max_len = max(len(p) + q.max_tokens for p, q in zip(prompts_ids, plist)) + bs
    dec = BlockDecoder(model, max_batch=len(prompts_ids), max_len=max_len, eos_ids=eos_ids,
                       tokenizer=tokenizer, use_cache=use_cache)
    seqs = [dec.new_sequence(p, q) for p, q in zip(prompts_ids, plist)]
    dec.add(seqs)
    running = list(seqs)
    while running:
        done = dec.step(running)
        running = [s for s in running if not s.is_finished]
        assert done or running
    return [to_output(s) for s in seqs]


