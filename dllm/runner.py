"""The block-causal runner: a scheduled batch in, one denoising forward on the device, the typed StepOutput out.

    runner = BlockRunner(model, max_batch=16, max_len=4096, num_pages=2048, compile=False, cuda_graphs=False)
    sched = Scheduler(runner.kv_budget, runner.postprocessor())      # dllm.scheduler: owns every KV page
    out = runner.run(sched.schedule(version=0))                      # -> dllm.postprocess.StepOutput

One step, in one place (Engine -> Runner -> the model's step): `run` prepares the step's typed inputs
(`dllm.step.StepInputs`, in bucketed buffers: dllm.step_inputs, one host-to-device copy), executes
`dllm.step.decode_step` eagerly, compiled (torch.compile, `compile=`; `static_shapes=` one graph per
bucket, else one dynamic graph) or as CUDA graphs (`cuda_graphs=`, a graph per bucket replayed:
dllm.cuda_graphs), reads back each sequence's block with one device-to-host copy and commits it
into the sequence (ids, steps, log-probabilities; a row whose probabilities were not finite changes
nothing). It keeps no account of slots or pages: each row's page table comes from the batch (the
block manager's `tables`, dllm.block_manager), and nothing of a sequence outlives its step here.

Per sequence: a newly admitted one owes the cache its clean prefix past `num_cached_tokens` (the
prompt blocks the prefix cache did not hold; after a preemption, its prompt and completion up to
its current block: recompute); a sequence whose block completed last step owes that block. Owed
blocks of one block ride along with the forward as extra rows; when an admitted sequence owes more,
every admitted sequence's prefix is written first by cache-filling forwards, in admission order (so
a row never reads a shared page before the row that computes it has written it: a sequence shares
only pages registered by sequences admitted before it, and within one forward each layer writes
all rows' K/V before any row reads), rows of similar lengths together (`_prefill_chunks`: little
padding; at most `max_prefill_tokens` tokens a forward). `use_cache=False` recomputes the whole
prefix every forward (the baseline the KV cache is tested against).
"""

from __future__ import annotations

import copy
import logging
from collections import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from dllm.attention import MaskSpec, decode_backend
from dllm.block_manager import KVBudget
from dllm.cuda_graphs import GraphedSteps
from dllm.intake import check_request
from dllm.kv_cache import KVCache
from dllm.model import SDARForCausalLM
from dllm.postprocess import Postprocessor, SeqOutput, StepOutput
from dllm.sampling import SamplingParams, needs_filter
from dllm.scheduler import S, ScheduledBatch
from dllm.sequence import Sequence
from dllm.step import StepInputs, StepResult, buckets, decode_step, sample_and_commit
from dllm.step_inputs import StepBuffers, pack, read_back, slots_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dlrl.dllm")
Key = tuple[int, int, int, bool]  # a step's bucket: (rows, sampled rows, keys, filtered)


class BlockRunner:
    """Runs scheduled batches of a block-causal model (SDAR) over its block-paged KV cache."""

    def __init__(self, model: SDARForCausalLM, *, max_batch: int, max_len: int, num_pages: int | None = None,
                 eos_ids: abc.Iterable[int] | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 use_cache: bool = True, compile: bool | str = False, cuda_graphs: bool = False,
                 static_shapes: bool = True, attention: str = "auto", optimistic: bool = False,
                 prefix_sharing: bool = True, max_graphs: int = 64, max_prefill_tokens: int = 8192) -> None:
        cfg = model.config
        B, dev = cfg.block_size, model.device
        self.model, self.tokenizer, self.use_cache = model, tokenizer, use_cache
        self.vocab_size, self.block_size, self.mask_id = cfg.vocab_size, B, cfg.mask_token_id
        self.eos_ids = list(cfg.eos_ids if eos_ids is None else eos_ids)
        self.max_batch, self.max_len = max_batch, max_len
        self.cache_len = -(-max_len // B) * B  # positions a sequence may reach (whole blocks)
        max_pages = self.cache_len // B
        pages = max_batch * max_pages if num_pages is None else num_pages
        self.cache = KVCache(cfg, pages, dev, model.dtype) if use_cache else None
        self.kv_budget = KVBudget(max_batch, pages if use_cache else 0, B, optimistic and use_cache, max_pages,
                                  prefix_sharing and use_cache)
        table_pages = 1 << (max_pages - 1).bit_length()  # keys in buckets of 1, 2, 4, ... pages, whatever max_len
        self.row_buckets = buckets(2 * max_batch)  # the sequences + the clean blocks they owe the cache
        self.max_sampled = max_batch
        self.kv_buckets = [p * B for p in buckets(table_pages)]
        self.buffers = StepBuffers(B, dev, max_rows=self.row_buckets[-1], max_sampled=self.bucket(max_batch, 1)[0],
                                   max_pages=table_pages)
        self._k_pos = {KV: torch.arange(KV, device=dev) for KV in self.kv_buckets}
        model.norms_on(dev)  # lazy state made now: a compiled graph guards on it
        self.attention = decode_backend(attention, dev, model.dtype, cfg.head_dim)
        self.static_shapes = bool(compile) and static_shapes
        self.fn: Callable[..., StepResult] = self._compiled(compile, static_shapes) if compile else decode_step
        self.graphs: GraphedSteps[StepResult] | None = None
        if cuda_graphs:
            self.graphs = GraphedSteps(self.fn, max_graphs)
        self.max_prefill_tokens = max_prefill_tokens  # padded tokens of one cache-filling forward (memory bound)
        self.num_forwards = 0  # denoising forwards
        self.num_fill_forwards = 0  # cache-filling forwards of their own (an admitted prefix of more than a block)
        self.num_prefill_positions = 0  # clean positions computed for admitted sequences (prompts, recomputes)
        log.info("decode step: %s, attention %s, row buckets %s, key buckets %s",
                 ("compiled, static shapes" if self.static_shapes else "compiled") if compile else "eager",
                 self.attention, self.row_buckets, self.kv_buckets)

    def _compiled(self, compile: bool | str, static_shapes: bool) -> Callable[..., StepResult]:
        backend = compile if isinstance(compile, str) else "inductor"  # a name: tests trace with "eager"
        cfg = torch._dynamo.config
        if static_shapes:  # one graph per bucket key: the limits must hold them all
            keys = len(self.keys())
            cfg.recompile_limit = max(cfg.recompile_limit, keys)
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 2 * keys)
        else:  # variants: 1 row or more, 1 sampled row or more, filtered or not (torch's default limit: 8)
            cfg.recompile_limit = max(cfg.recompile_limit, 16)
            for t in self._k_pos.values():
                if t.shape[0] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return torch.compile(decode_step, fullgraph=True, backend=backend, dynamic=False if static_shapes else None)

    # ------------------------------------------------------------------ sequences in
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """FieldError (TooLong when it does not fit) for a prompt or parameters this runner cannot run."""
        check_request(prompt_ids, params, max_len=self.cache_len, block_size=self.block_size,
                      vocab_size=self.vocab_size, mask_id=self.mask_id)

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None) -> Sequence:
        self.validate(prompt_ids, params)
        return Sequence(prompt_ids, params, self.block_size, self.mask_id, seq_id)

    def postprocessor(self) -> Postprocessor:
        """The stop rules for the scheduler (its own tokenizer instance: the scheduler's thread only)."""
        tok = copy.deepcopy(self.tokenizer) if self.tokenizer is not None else None
        return Postprocessor(eos_ids=self.eos_ids, tokenizer=tok, max_len=self.cache_len, block_size=self.block_size)

    def release(self, seqs: abc.Sequence[Sequence]) -> None:
        """Sequences that left: nothing to drop (this runner keeps nothing of a sequence between steps)."""

    # ------------------------------------------------------------------ the step
    def bucket(self, num_rows: int, kv_len: int) -> tuple[int, int]:
        return next(r for r in self.row_buckets if r >= num_rows), next(k for k in self.kv_buckets if k >= kv_len)

    @torch.no_grad()
    def run(self, batch: ScheduledBatch[S]) -> StepOutput:
        """One denoising forward for every sequence of `batch.running` (no post-processing): admitted ones
        owe their prefix, a sequence whose block completed moves on first. Returns per sequence its block
        after the forward and whether its probabilities were finite (`seq.block_done`: for the Postprocessor)."""
        seqs = batch.running
        if not seqs:
            return StepOutput([], 0)
        self._admit(batch.admitted)
        for s in seqs:
            if s.block_done:
                s.next_block(owe_cache=self.use_cache)
        filtered = any(needs_filter(s.params) for s in seqs)
        if self.cache is None:
            x = self._prepare(seqs, [], None, len(seqs), len(seqs), 1)
            res = sample_and_commit(self._logits_no_cache(seqs), x, self.mask_id, filtered)
        else:
            assert batch.tables is not None, "run: a paged runner needs the block manager's page tables"
            owed = [s for s in batch.admitted if s.pending is not None]
            if any(len(p) > self.block_size for s in owed if (p := s.pending) is not None):
                for chunk in self._prefill_chunks(owed):  # every admitted prefix, in admission order
                    self._prefill(chunk, batch.tables)
            owed = [s for s in seqs if s.pending is not None]  # one block each: rows of this forward
            R, KV = self.bucket(len(seqs) + len(owed), max(s.end_pos for s in seqs))
            Rn = self.bucket(len(seqs), 1)[0]
            x = self._prepare(seqs, owed, batch.tables, R, Rn, KV // self.block_size)
            args = (self.model, self.cache, x, self._k_pos[KV], filtered, self.attention)
            res = self.graphs.run((R, Rn, KV, filtered), args) if self.graphs is not None else self.fn(*args)
        self.num_forwards += 1
        for s in seqs:
            s.pending = None
        return self._commit(seqs, res)

    def _admit(self, admitted: abc.Sequence[Sequence]) -> None:
        """What each admitted sequence owes the cache: its clean prefix past the cached blocks (a preempted
        one first moves past a block it had completed: that block is part of its prefix now)."""
        for s in admitted:
            if s.block_done:
                s.next_block(owe_cache=False)
            clean = (s.prompt_ids + s.completion_ids)[:s.block_start][s.num_cached_tokens:]
            s.pending = clean if self.use_cache and clean else None
            self.num_prefill_positions += len(clean) if self.use_cache else 0

    def _prepare(self, seqs: abc.Sequence[Sequence], owed: abc.Sequence[Sequence], tables: np.ndarray | None,
                 R: int, Rn: int, P: int) -> StepInputs:
        """The step's typed inputs in the bucket's buffers (dllm.step_inputs.pack), on the device."""
        x = pack(self.buffers, seqs, owed, tables, R, Rn, P, self.mask_id)
        self.buffers.upload(R, Rn, P)
        return x

    def _commit(self, seqs: abc.Sequence[Sequence], res: StepResult) -> StepOutput:
        """The one device-to-host copy (dllm.step_inputs.read_back), then each sequence's block updated in place
        (ok rows only): committed positions take their token, step and log-probability."""
        ids, lp, com, ok = read_back(res, len(seqs))
        outputs, num = [], 0
        for r, s in enumerate(seqs):
            s.num_forwards += 1
            s.step_in_block += 1
            if ok[r]:
                s.block_ids = ids[r]
                if any(com[r]):
                    steps, logprobs, lp_r = s.block_steps, s.block_logprobs, lp[r]
                    for i, hit in enumerate(com[r]):
                        if hit:
                            steps[i], logprobs[i] = s.step_in_block, lp_r[i]
                            num += 1
                s.block_done = self.mask_id not in s.block_ids
            outputs.append(SeqOutput(s, bool(ok[r])))
        return StepOutput(outputs, num)

    def _prefill_chunks(self, owed: abc.Sequence[Sequence]) -> list[list[Sequence]]:
        """The admitted sequences' prefills as forwards of consecutive sequences (admission order: a
        sequence reads only pages registered by those admitted before it, so its writer runs in the same
        forward or an earlier one), each of rows within 2x of one another's length (the padding of a
        forward stays under half of it) and of at most `max_prefill_tokens` padded tokens."""
        chunks: list[list[Sequence]] = []
        lo = hi = 0
        for s in owed:
            n = len(s.pending or ())
            if chunks and max(hi, n) <= 2 * min(lo, n) and (len(chunks[-1]) + 1) * max(hi, n) <= self.max_prefill_tokens:
                chunks[-1].append(s)
                lo, hi = min(lo, n), max(hi, n)
            else:
                chunks.append([s])
                lo = hi = n
        return chunks

    def _prefill(self, seqs: abc.Sequence[Sequence], tables: np.ndarray) -> None:
        """One cache-filling forward (no logits) of the admitted sequences' owed prefixes (one row each)."""
        pending = [p for s in seqs if (p := s.pending) is not None]
        L = max(len(p) for p in pending)
        ids = torch.full((len(seqs), L), self.mask_id, dtype=torch.long)
        valid = torch.zeros(len(seqs), L, dtype=torch.bool)  # padding writes into the scratch page
        for r, p in enumerate(pending):
            ids[r, :len(p)] = torch.tensor(p)
            valid[r, :len(p)] = True
        starts = [s.block_start - len(p) for s, p in zip(seqs, pending)]
        dev = self.model.device
        pos = (torch.tensor(starts, device=dev)[:, None] + torch.arange(L, device=dev)).clamp_(max=self.cache_len - 1)
        table = torch.from_numpy(tables[slots_of(seqs)]).to(dev)
        self.model(ids.to(dev), pos, cache=self.cache, page_table=table, kv_len=min(self.cache_len, max(starts) + L),
                   write_mask=valid.to(dev), num_logits=0)
        self.num_fill_forwards += 1
        for s in seqs:
            s.pending = None

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

    # ------------------------------------------------------------------ buckets ahead of traffic
    def keys(self, max_kv: int | None = None, filtered: tuple[bool, ...] = (False, True)) -> list[Key]:
        """Every bucket key (rows, sampled rows, keys, filtered) a step can meet (keys up to `max_kv`)."""
        kvs = [k for k in self.kv_buckets if max_kv is None or k <= self.bucket(1, max_kv)[1]]
        sampled = [r for r in self.row_buckets if r <= self.bucket(self.max_sampled, 1)[0]]
        return [(R, Rn, KV, f) for R in self.row_buckets for Rn in sampled if Rn <= R for KV in kvs for f in filtered]

    @torch.no_grad()
    def warmup(self, max_kv: int | None = None, filtered: tuple[bool, ...] = (False, True)) -> int:
        """Run every bucket key's step once on padding rows (they write only the scratch page): each
        compiled / captured before traffic, so none compiles later. Returns the keys run."""
        keys = self.keys(max_kv, filtered)
        for R, Rn, KV, f in keys:
            x = self._prepare([], [], None, R, Rn, KV // self.block_size)
            args = (self.model, self.cache, x, self._k_pos[KV], f, self.attention)
            self.graphs.run((R, Rn, KV, f), args) if self.graphs is not None else self.fn(*args)
        return len(keys)

    def close(self) -> None:
        self.cache = None
