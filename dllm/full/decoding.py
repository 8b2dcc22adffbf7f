"""Block-wise decoding of full-attention diffusion LMs (LLaDA, Dream) with exact traces; two cache modes.

    outs = generate_full(model, [prompt_ids, ...], SamplingParams(max_tokens=32), tok, cache_mode="exact")
    dec = FullDecoder(model, max_batch=16, max_len=4096, tokenizer=tok, cache_mode="prefix")
    seq = dec.new_sequence(prompt_ids, params); dec.add([seq])
    out = dec.run(running)                      # ONE denoising forward for every sequence (a server Runner's step)
    finished = dec.postprocess(out.outputs)     # dllm.postprocess.Postprocessor, as for BlockDecoder
    finished = dec.step(running)                # run + postprocess + release (standalone)

Each sequence decodes on a canvas of `canvas_len` = prompt + max_tokens rounded up to whole blocks (blocks are
aligned to absolute position 0, as the Trace contract says; a prompt's last partial block is completed by the
first generated tokens). Blocks are decoded left to right; inside a block, each forward samples every masked
position (dllm.sampling: temperature, top-k, top-p, counter-based noise) and commits some of them
(dllm.commit: static k per step, dynamic threshold, sequential) -- exactly BlockDecoder's per-block rules, with
the sequence's block, steps and log-probabilities in `seq.block_ids / block_steps / block_logprobs`, so
`dllm.postprocess.Postprocessor` (stop ids, stop strings, max_tokens, the tail of a truncated block) and
`dllm.decoding.StepOutput` apply unchanged. Per family (the reference rollouts of Gen-Verse/dLLM-RL):
- Dream: logits are shifted (position i is predicted from the hidden state at i - 1, dllm.full.model);
  the first forward of a block commits only the block's first masked position (sampled directly: the
  reference's first-token rule), the rest follow the strategy; `pad_penalty` divides the confidence of a
  position whose sampled token is the pad id (the reference's `pad_target_penalty`, 1.0 = off).
- LLaDA: no shift, no first-token rule.
Stopping: the Postprocessor ends a sequence at the end of the first block holding a stop id (eos/pad) and
cuts the completion there; later blocks never change earlier ones, so the completion equals the
reference's (which goes on decoding until a whole block is pad, or to the end) cut at its first stop id.

Cache modes (`cache_mode`, one per decoder, recorded in every trace):
- "exact": every forward runs the whole canvas (prompt, decoded blocks, the current block, the later still
  masked blocks), bidirectionally. What it sees is exactly `dllm.full.replay`'s row for that step, so the
  sampler's log-probabilities are what replay recomputes (fp32: < 1e-4).
- "prefix" (Fast-dLLM's prefix cache): a block's first forward runs the whole canvas and keeps every layer's
  K/V of the positions before the block; the block's later forwards run only [block start, canvas end)
  against those cached K/V. Cheaper; approximate (cached keys/values were computed while the current
  block was still masked), so replay differs a little (measured in the tests; TIS / MIS correct it).
Sequences of a batch are padded to the longest canvas (padding is invisible: `valid`); with the prefix
cache, sequences at a block's first forward and the others run as two forwards of one `run`.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dllm.commit import commit_mask, transfer_schedule
from dllm.errors import FieldError
from dllm.full.model import KV, FullAttentionLM
from dllm.intake import Intake
from dllm.postprocess import Postprocessor, StepOutput, apply_step
from dllm.sampling import PARAM_FIELDS, SamplingParams, counter_uniforms, needs_filter, sample_static
from dllm.sequence import GenerationOutput, Sequence, step_inputs, to_output
from dllm.step import FIELDS, columns
from dllm.strategy import Strategy
from dllm.trace import FinishReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_MODES = ("exact", "prefix")


@dataclass
class FullState:
    """What the decoder keeps per sequence besides its `dllm.sequence.Sequence` (keyed by seq_id)."""

    canvas_len: int  # prompt + max_tokens, to whole blocks: the length every forward sees
    past: list[KV] | None = None  # prefix cache: every layer's K/V [1, Hkv, past_len, D]
    past_len: int = -1  # the block start the cache was made for
    ruled_block: int = -1  # the block start whose schedule got Dream's first-token rule


def canvas_len(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """Positions every forward of a sequence sees: prompt + max_tokens, rounded up to whole blocks."""
    return -(-(prompt_len + max_tokens) // block_size) * block_size


def canvas(s: Sequence, length: int) -> list[int]:
    """The ids a forward sees now: the decoded prefix, the current block, masks up to `length`."""
    done = (s.prompt_ids + s.completion_ids)[:s.block_start]
    return done + s.block_ids + [s.mask_id] * (length - s.end_pos)


class FullDecoder(Intake):
    """Batched block decoding for FullAttentionLM (see the module docstring); BlockDecoder's interface."""

    def __init__(self, model: FullAttentionLM, *, max_batch: int, max_len: int | None = None,
                 eos_ids: abc.Iterable[int] | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 cache_mode: str = "exact", pad_penalty: float = 1.0) -> None:
        if cache_mode not in CACHE_MODES:
            raise FieldError("cache_mode", f"unknown {cache_mode!r} (known: {', '.join(CACHE_MODES)})")
        if not pad_penalty > 0:
            raise FieldError("pad_penalty", f"must be > 0, got {pad_penalty!r}")
        cfg = model.config
        self.model, self.tokenizer, self.cache_mode, self.pad_penalty = model, tokenizer, cache_mode, pad_penalty
        self.vocab_size, self.block_size, self.mask_id = cfg.vocab_size, cfg.block_size, cfg.mask_token_id
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else -1
        self.shift = cfg.logit_shift
        self.eos_ids = list(cfg.eos_ids if eos_ids is None else eos_ids)
        limit = cfg.max_position_embeddings if max_len is None else max_len
        self.max_len = -(-limit // self.block_size) * self.block_size
        self.max_batch = max_batch
        self.postprocess = Postprocessor(eos_ids=self.eos_ids, tokenizer=tokenizer, max_len=self.max_len,
                                         block_size=self.block_size)
        self.free_slots = list(range(max_batch))[::-1]
        self.states: dict[int, FullState] = {}  # per added sequence (seq_id)
        self.num_forwards = 0  # denoising forwards (model calls: a prefix-mode run may make two)

    def num_admissible(self, seqs: abc.Sequence[Sequence]) -> int:
        """How many of `seqs` can be added now (free slots; no KV pages: the canvas is recomputed)."""
        return min(len(seqs), len(self.free_slots))

    def add(self, seqs: Sequence | abc.Sequence[Sequence]) -> None:
        seqs = [seqs] if isinstance(seqs, Sequence) else list(seqs)
        if self.num_admissible(seqs) < len(seqs):
            raise FieldError("n", f"cannot add {len(seqs)} sequences: {len(self.free_slots)} free slots")
        for s in seqs:
            if s.slot is None:
                s.slot = self.free_slots.pop()
            else:
                self.free_slots.remove(s.slot)
            n = canvas_len(len(s.prompt_ids), s.params.max_tokens, self.block_size)
            self.states[s.seq_id] = FullState(n)
            s.trace.cache_mode, s.trace.canvas_len = self.cache_mode, n

    def release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        self.states.pop(seq.seq_id, None)
        if seq.finish_reason is None:
            seq.finish_reason = FinishReason.ABORT

    @torch.no_grad()
    def run(self, seqs: abc.Sequence[Sequence]) -> StepOutput:
        """One denoising forward for every sequence (no post-processing): a sequence whose block completed
        last time moves on first. Returns per sequence its block after the forward and whether its
        probabilities were finite (`seq.block_done` tells the Postprocessor the block is complete)."""
        if not seqs:
            return StepOutput([], 0)
        fs = list(seqs)
        for s in fs:
            if s.seq_id not in self.states:
                raise KeyError(f"FullDecoder.run: sequence {s.seq_id} was not added")
            if s.block_done:
                s.next_block(owe_cache=False)
            self._first_token_rule(s)
        before = sum(len(s.masked_positions()) for s in fs)
        cached = [self.cache_mode == "prefix" and self.states[s.seq_id].past_len == s.block_start for s in fs]
        logits: list[torch.Tensor | None] = [None] * len(fs)
        for use_cache in (False, True):
            idx = [i for i, c in enumerate(cached) if c == use_cache]
            if idx:
                group = [fs[i] for i in idx]
                out = self._prefix_logits(group) if use_cache else self._canvas_logits(group)
                for i, row in zip(idx, out):
                    logits[i] = row
                self.num_forwards += 1
        rows = self._pack(fs)
        filtered = any(needs_filter(s.params) for s in fs)
        block_logits = torch.stack([t for t in logits if t is not None])  # [N, B, V]
        res = sample_and_commit_full(block_logits, torch.from_numpy(rows).to(self.model.device), self.mask_id,
                                     filtered, self.pad_id, self.pad_penalty).cpu()
        return apply_step(fs, res, self.block_size, self.mask_id, before)

    def step(self, seqs: list[Sequence]) -> list[Sequence]:
        """Standalone decoding: `run`, post-process, release the sequences that ended; returns them."""
        finished = self.postprocess(self.run(seqs).outputs)
        for s in finished:
            self.release(s)
        return finished

    def _first_token_rule(self, s: Sequence) -> None:
        """Dream: a block's first forward commits its first masked position alone (schedule [1, ...])."""
        st = self.states[s.seq_id]
        if self.model.family != "dream" or st.ruled_block == s.block_start:
            return
        st.ruled_block = s.block_start
        n = len(s.masked_positions())
        if n > 1:
            s.schedule = [1, *transfer_schedule(n - 1, max(1, (s.params.steps or self.block_size) - 1))]

    def _pack(self, seqs: list[Sequence]) -> np.ndarray:
        """dllm.step's row layout per sequence (block, step fields, sampling parameters, uniforms); Dream's
        first forward of a block commits the first masked position only (sequential, k = 1)."""
        B = self.block_size
        rows = np.array([step_inputs(s) for s in seqs], dtype=np.float64)
        col = columns(B)
        for r, s in enumerate(seqs):
            if self.model.family == "dream" and s.step_in_block == 0 and len(s.masked_positions()) > 1:
                rows[r, col["k"]], rows[r, col["strategy"]] = 1, Strategy.sequential.code
        noise = counter_uniforms([s.seed for s in seqs], rows[:, col["block_start"], None] + np.arange(B),
                                 rows[:, col["step"]])
        return np.concatenate([rows, noise], axis=1)

    def _block_rows(self, hidden: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """hidden [N, L, D], the block's first index per row -> logits of the block's positions [N, B, V]
        (Dream: from the hidden state one position earlier; index 0 keeps its own, as the reference)."""
        idx = (torch.tensor(starts)[:, None] + torch.arange(self.block_size) - self.shift).clamp_(min=0)
        idx = idx.to(hidden.device)
        picked = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.model.head(picked)

    def _canvas_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """The whole canvas of each sequence, bidirectionally -> the block's logits [n, B, V]; in prefix
        mode each sequence keeps its K/V before the block (the prefix cache of this block)."""
        dev = self.model.device
        states = [self.states[s.seq_id] for s in seqs]
        L = max(st.canvas_len for st in states)
        ids = torch.full((len(seqs), L), self.mask_id, dtype=torch.long)
        valid = torch.zeros(len(seqs), L, dtype=torch.bool)
        for r, (s, st) in enumerate(zip(seqs, states)):
            ids[r, :st.canvas_len] = torch.tensor(canvas(s, st.canvas_len))
            valid[r, :st.canvas_len] = True
        pos = torch.arange(L, device=dev).expand(len(seqs), L)
        keep = self.cache_mode == "prefix"
        hidden, kv = self.model.hidden_states(ids.to(dev), pos, valid.to(dev), keep_kv=keep)
        if kv is not None:
            for r, (s, st) in enumerate(zip(seqs, states)):
                st.past = [(k[r:r + 1, :, :s.block_start].clone(), v[r:r + 1, :, :s.block_start].clone()) for k, v in kv]
                st.past_len = s.block_start
        return self._block_rows(hidden, [s.block_start for s in seqs])

    def _prefix_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Prefix cache: only [block start, canvas end) runs, attending to the cached K/V before it."""
        dev = self.model.device
        states = [self.states[s.seq_id] for s in seqs]
        P = max(st.past_len for st in states)
        W = max(st.canvas_len - s.block_start for s, st in zip(seqs, states))
        ids = torch.full((len(seqs), W), self.mask_id, dtype=torch.long)
        valid = torch.zeros(len(seqs), W, dtype=torch.bool)
        pos = torch.zeros(len(seqs), W, dtype=torch.long)
        past_valid = torch.zeros(len(seqs), P, dtype=torch.bool)
        for r, (s, st) in enumerate(zip(seqs, states)):
            win = canvas(s, st.canvas_len)[s.block_start:]
            ids[r, :len(win)] = torch.tensor(win)
            valid[r, :len(win)] = True
            pos[r] = s.block_start + torch.arange(W)
            past_valid[r, :st.past_len] = True
        past = []
        for layer in range(len(self.model.layers)):
            ks, vs = [], []
            for st in states:
                assert st.past is not None
                k, v = st.past[layer]
                pad = P - k.shape[2]
                ks.append(torch.nn.functional.pad(k, (0, 0, 0, pad)))
                vs.append(torch.nn.functional.pad(v, (0, 0, 0, pad)))
            past.append((torch.cat(ks), torch.cat(vs)))
        hidden, _ = self.model.hidden_states(ids.to(dev), pos.to(dev), valid.to(dev), past=past,
                                             past_valid=past_valid.to(dev))
        return self._block_rows(hidden, [0] * len(seqs))


def sample_and_commit_full(logits: torch.Tensor, rows: torch.Tensor, mask_id: int, filtered: bool, pad_id: int,
                           pad_penalty: float) -> torch.Tensor:
    """dllm.step.sample_and_commit with the reference's pad-confidence penalty: logits [R, B, V], rows
    [R, width(B)] -> [R, 3B + 1] (new block ids, steps, logprobs, finite flag)."""
    R, B = logits.shape[:2]
    col, f = columns(B), 3 * B + len(FIELDS)
    params = rows[:, col[PARAM_FIELDS[0]]:col[PARAM_FIELDS[-1]] + 1]
    tok, lp = sample_static(logits, params, rows[:, f:f + B], mask_id, filtered)
    masked = rows[:, :B] == mask_id
    is_ok = (torch.isfinite(lp) | ~masked).all(-1)
    conf = lp.exp()
    if pad_penalty != 1.0:
        conf = torch.where(tok == pad_id, conf / pad_penalty, conf)
    commit = commit_mask(conf, masked, rows[:, col["k"]].long(), rows[:, col["threshold"]].float(),
                         rows[:, col["strategy"]].long()) & is_ok[:, None]
    step = rows[:, col["step"], None].expand(R, B)
    new = torch.stack([tok.double(), step, lp.double()], 1)
    block = torch.where(commit[:, None], new, rows[:, :3 * B].reshape(R, 3, B))
    return torch.cat([block.reshape(R, 3 * B), is_ok[:, None].double()], 1)


def generate_full(model: FullAttentionLM, prompts_ids: list[list[int]], params: SamplingParams | list[SamplingParams],
                  tokenizer: PreTrainedTokenizerBase | None = None, cache_mode: str = "exact",
                  eos_ids: abc.Iterable[int] | None = None, pad_penalty: float = 1.0) -> list[GenerationOutput]:
    """Decode all prompts together; one GenerationOutput per prompt, in order (trace included)."""
    plist = params if isinstance(params, list) else [params] * len(prompts_ids)
    max_len = max(len(p) + q.max_tokens for p, q in zip(prompts_ids, plist)) + model.config.block_size
    dec = FullDecoder(model, max_batch=len(prompts_ids), max_len=max_len, eos_ids=eos_ids, tokenizer=tokenizer,
                      cache_mode=cache_mode, pad_penalty=pad_penalty)
    seqs = [dec.new_sequence(p, q) for p, q in zip(prompts_ids, plist)]
    dec.add(seqs)
    running: list[Sequence] = list(seqs)
    while running:
        done = dec.step(running)
        running = [s for s in running if not s.is_finished]
        assert done or running
    return [to_output(s) for s in seqs]
