"""Block-diffusion decoding with a KV cache and exact traces.

    outs = generate(model, [prompt_ids, ...], SamplingParams(max_tokens=32, temperature=0), tokenizer)
    outs[0].completion_ids, outs[0].text, outs[0].trace.steps, outs[0].trace.logprobs

Blocks are aligned to absolute position 0. For each sequence: prefill its complete
prompt blocks into the cache; then per block run denoising forwards, each committing
some masked tokens (strategy `static`, `dynamic` or `sequential`), until no mask is
left; then one clean forward writes the block's K/V into the cache. `BlockDecoder`
does this for many sequences at once, each at its own position; the server's
continuous-batching engine drives it step by step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from dllm.attention import MaskSpec
from dllm.model import KVCache, SDARForCausalLM
from dllm.sampling import SamplingParams, sample_tokens, sampling_logprobs
from dllm.trace import Trace

_ids = itertools.count()


def transfer_schedule(num_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` forwards for a block with `num_masked` masks."""
    steps = max(1, min(steps, num_masked))
    base, rem = divmod(num_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


class Sequence:
    """Decoding state of one sample (plain data; the decoder mutates it)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, block_size: int, mask_id: int,
                 seq_id: int | None = None):
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.block_size = block_size
        self.mask_id = mask_id
        self.completion_ids: list[int] = []
        self.trace = Trace(prompt_len=len(prompt_ids), block_size=block_size)
        self.finish_reason: str | None = None
        self.num_forwards = 0
        self.slot: int | None = None
        self.text = ""
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        prefill = len(prompt_ids) // block_size * block_size
        self.block_start = prefill
        self._new_block()

    def _new_block(self) -> None:
        B, start = self.block_size, self.block_start
        self.block_ids = [self.mask_id] * B
        given = self.prompt_ids[start:start + B]  # prompt tail inside the first block
        self.block_ids[:len(given)] = given
        self.block_steps = [0] * B
        self.block_logprobs = [0.0] * B
        self.step_in_block = 0
        masked = B - len(given)
        self.schedule = transfer_schedule(masked, self.params.steps or B)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def end_pos(self) -> int:
        return self.block_start + self.block_size

    def masked_positions(self) -> list[int]:
        return [i for i, t in enumerate(self.block_ids) if t == self.mask_id and self._is_gen(i)]

    def _is_gen(self, i: int) -> bool:
        return self.block_start + i >= len(self.prompt_ids)


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: str
    trace: Trace
    num_forwards: int


def choose_positions(seq: Sequence, conf: torch.Tensor) -> list[int]:
    """Which masked positions of the block to commit this forward. conf: [B] prob of sampled token."""
    masked = seq.masked_positions()
    p = seq.params
    k = seq.schedule[min(seq.step_in_block - 1, len(seq.schedule) - 1)]
    if p.strategy == "sequential":
        return masked[:k]
    ranked = sorted(masked, key=lambda i: -float(conf[i]))
    if p.strategy == "static":
        return ranked[:k]
    chosen = [i for i in ranked if float(conf[i]) >= p.threshold]
    return chosen or ranked[:1]


class BlockDecoder:
    """Batched block decoding over a preallocated KV cache (one slot per sequence)."""

    def __init__(self, model: SDARForCausalLM, *, max_batch: int, max_len: int, eos_ids=None,
                 tokenizer=None, use_cache: bool = True):
        cfg = model.config
        self.model, self.tokenizer, self.use_cache = model, tokenizer, use_cache
        self.block_size, self.mask_id = cfg.block_size, cfg.mask_token_id
        self.eos_ids = list(cfg.eos_ids if eos_ids is None else eos_ids)
        self.max_len = (max_len + self.block_size - 1) // self.block_size * self.block_size
        self.cache = KVCache(cfg, max_batch, self.max_len, model.device, model.dtype) if use_cache else None
        self.free_slots = list(range(max_batch))[::-1]
        self.num_forwards = 0  # denoising forwards
        self.num_commit_forwards = 0
        self.num_prefill_forwards = 0
        self.num_tokens = 0

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def new_sequence(self, prompt_ids, params: SamplingParams, seq_id=None) -> Sequence:
        params.validate(self.block_size)
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        for t in prompt_ids:
            if not 0 <= t < vocab or t == self.mask_id:
                raise ValueError(f"prompt_ids: invalid token id {t} (vocab {vocab}, mask id {self.mask_id})")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) "
                             f"exceeds the maximum sequence length {self.max_len}")
        return Sequence(prompt_ids, params, self.block_size, self.mask_id, seq_id)

    @torch.no_grad()
    def add(self, seqs: Sequence | list[Sequence]) -> None:
        """Allocate slots and prefill the complete prompt blocks of the new sequences."""
        seqs = [seqs] if isinstance(seqs, Sequence) else seqs
        if len(seqs) > len(self.free_slots):
            raise RuntimeError(f"no free decoding slot ({len(self.free_slots)} free, {len(seqs)} asked)")
        for s in seqs:
            s.slot = self.free_slots.pop()
        todo = [s for s in seqs if s.block_start > 0]
        if not todo or not self.use_cache:
            return
        L = max(s.block_start for s in todo)
        dev = self.model.device
        ids = torch.full((len(todo), L), self.mask_id, dtype=torch.long)
        for r, s in enumerate(todo):
            ids[r, :s.block_start] = torch.tensor(s.prompt_ids[:s.block_start])
        pos = torch.arange(L).expand(len(todo), L)
        slots = torch.tensor([s.slot for s in todo])
        self.model(ids.to(dev), pos.to(dev), cache=self.cache, slots=slots.to(dev))
        self.num_prefill_forwards += 1

    def release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def _logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """One denoising forward -> logits of each sequence's current block [N, B, V]."""
        dev, B = self.model.device, self.block_size
        if self.use_cache:
            ids = torch.tensor([s.block_ids for s in seqs])
            pos = torch.stack([torch.arange(s.block_start, s.end_pos) for s in seqs])
            slots = torch.tensor([s.slot for s in seqs])
            return self.model(ids.to(dev), pos.to(dev), cache=self.cache, slots=slots.to(dev))
        # no-cache baseline: recompute the whole prefix every forward
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
    def step(self, seqs: list[Sequence]) -> list[Sequence]:
        """One denoising forward for every sequence; returns those that finished."""
        if not seqs:
            return []
        logits = self._logits(seqs)  # [N, B, V]
        self.num_forwards += 1
        completed = []
        for r, s in enumerate(seqs):
            s.num_forwards += 1
            s.step_in_block += 1
            logp = sampling_logprobs(logits[r], s.params, self.mask_id)  # [B, V]
            ids, tok_logp = sample_tokens(logp, s.params, s.generator)
            chosen = choose_positions(s, tok_logp.exp())
            for i in chosen:
                s.block_ids[i] = int(ids[i])
                s.block_steps[i] = s.step_in_block
                s.block_logprobs[i] = float(tok_logp[i])
            if not s.masked_positions():
                completed.append(s)
        return self._complete_blocks(completed)

    def _complete_blocks(self, seqs: list[Sequence]) -> list[Sequence]:
        finished, going = [], []
        for s in seqs:
            self._append_block(s)
            (finished if s.is_finished else going).append(s)
        if going and self.use_cache:  # clean forward: write the committed blocks' K/V
            dev = self.model.device
            ids = torch.tensor([s.block_ids for s in going])
            pos = torch.stack([torch.arange(s.block_start, s.end_pos) for s in going])
            slots = torch.tensor([s.slot for s in going])
            self.model(ids.to(dev), pos.to(dev), cache=self.cache, slots=slots.to(dev))
            self.num_commit_forwards += 1
        for s in going:
            s.block_start += self.block_size
            s._new_block()
        for s in finished:
            self.release(s)
        return finished

    def _append_block(self, s: Sequence) -> None:
        """Move the finished block into the completion; apply stop rules."""
        first = max(0, len(s.prompt_ids) - s.block_start)
        new_ids = s.block_ids[first:]
        new_steps, new_lp = s.block_steps[first:], s.block_logprobs[first:]
        p = s.params
        keep, reason = len(new_ids), None
        stop_ids = set(self.eos_ids if p.stop_token_ids is None else p.stop_token_ids)
        if not p.ignore_eos:
            hit = next((i for i, t in enumerate(new_ids) if t in stop_ids), None)
            if hit is not None:
                keep, reason = hit + 1, "stop"
        if self.tokenizer is not None and p.stop:
            n = self._stop_string_cut(s, new_ids[:keep])
            if n is not None:
                keep, reason = n, "stop"
        room = p.max_tokens - len(s.completion_ids)
        if keep > room or (keep == room and reason is None):
            keep, reason = room, "length"
        s.completion_ids += new_ids[:keep]
        s.trace.steps += new_steps[:keep]
        s.trace.logprobs += new_lp[:keep]
        self.num_tokens += keep
        if self.tokenizer is not None:
            s.text = self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
            cuts = [s.text.find(st) for st in p.stop if st in s.text]
            if cuts:
                s.text = s.text[:min(cuts)]
        if reason is None and s.end_pos + self.block_size > self.max_len:
            reason = "length"
        if reason is not None:
            s.trace.tail_ids = new_ids[keep:]
            s.trace.tail_steps = new_steps[keep:]
            s.finish_reason = s.trace.finish_reason = reason

    def _stop_string_cut(self, s: Sequence, cand: list[int]) -> int | None:
        """Fewest of the block's new tokens after which the text contains a stop string."""
        def has_stop(ids):
            text = self.tokenizer.decode(s.completion_ids + ids, skip_special_tokens=True)
            return any(st in text for st in s.params.stop)

        if not has_stop(cand):
            return None
        return next(n for n in range(1, len(cand) + 1) if has_stop(cand[:n]))


def generate(model: SDARForCausalLM, prompts_ids: list[list[int]], params: SamplingParams | list[SamplingParams],
             tokenizer=None, use_cache: bool = True, eos_ids=None) -> list[GenerationOutput]:
    """Decode all prompts together; returns one GenerationOutput per prompt, in order."""
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
    return [to_output(s, tokenizer) for s in seqs]


def to_output(s: Sequence, tokenizer=None) -> GenerationOutput:
    return GenerationOutput(s.prompt_ids, s.completion_ids, s.text, s.finish_reason, s.trace, s.num_forwards)
