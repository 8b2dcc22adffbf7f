"""The full-attention runner: block-wise decoding of full-attention diffusion LMs (LLaDA, Dream) as their official
rollouts decode them, with exact traces; two cache modes. dllm.runner.BlockRunner's shape.

    runner = FullRunner(model, max_batch=16, max_len=4096, tokenizer=tok, cache_mode="prefix", further_horizon=128)
    sched = Scheduler(runner.kv_budget, runner.postprocessor())      # dllm.scheduler: owns every slot
    out = runner.run(sched.schedule(version=0))  # ONE denoising forward for every sequence -> StepOutput
    dec = Decoder(runner); dec.add(runner.new_sequence(prompt_ids, params)); dec.run()   # standalone (dllm.decoding)

Engine -> Runner -> the model: `run` takes the scheduler's batch (dllm.scheduler.ScheduledBatch), sets up the
sequences it admitted, runs one forward and returns the typed `dllm.postprocess.StepOutput`; the scheduler
post-processes it. The runner keeps no account of slots (the scheduler's block manager hands them out, with
`kv_budget` = slots only: `num_pages=0`, there is no block-paged cache), writes no finish reason, and drops
its per-sequence state (canvas length, prefix cache, generator: `FullState`) when the scheduler says a
sequence left (`release(batch.left)`). `dllm.full.decoding.generate_full` is this runner driven by
`dllm.decoding.Decoder`, the server engine's loop.

The official semantics (Gen-Verse/dLLM-RL: `sample/llada_rl_rollout.py: generate_with_prefix_cache`,
`sample/dream_rl_rollout.py: _sample`; tests/dllm/test_official_equivalence.py checks token- and step-identity
with their outputs, tests/fixtures/official_full_decoding.json):
- the canvas is the prompt + max_tokens rounded up to whole blocks, and the first block starts at the
  prompt's end (`Sequence.start_blocks_at`, recorded as the trace's `block_origin`); blocks are decoded left
  to right, every forward sampling each masked position of the block (dllm.full.sampler: mask id excluded,
  temperature, top-p then top-k, counter-based noise or the official torch draws, `rng`);
- static decoding commits the k most confident per forward with the family's schedule (dllm.full.schedule:
  LLaDA's `get_num_transfer_tokens`, Dream's first token then its `eps` timesteps), ranked by the family's
  confidence (`ranking`); dynamic decoding every position at or above the threshold, at least one;
- Dream: logits are shifted (position i is predicted from the hidden state at i - 1, dllm.full.model); a
  block's first forward commits its first position alone (sampled directly); `pad_penalty` divides the
  confidence of a pad token (`pad_target_penalty`). LLaDA: no shift, no first-token rule.
Stopping: the scheduler's Postprocessor ends a sequence at the end of the first block holding a stop id and cuts the
completion after it (the rest of that block is the trace's tail). The official rollouts decode on (LLaDA to the
end of the canvas, Dream until a whole block is pad); later blocks never change earlier ones, so the
completion is theirs up to its first stop id, and with `ignore_eos` the whole of theirs (unless a Dream block
came out all pad without pad being a stop id: the official code then fills the rest with pad).

Cache modes (`cache_mode`, one per runner, recorded in every trace):
- "exact": every forward runs the whole canvas (prompt, decoded blocks, the current block, the later still
  masked blocks), bidirectionally: the official `use_cache=False`. What it sees is exactly
  `dllm.full.replay`'s row for that step, so the sampler's log-probabilities are what replay recomputes
  (fp32: < 1e-4).
- "prefix" (the official `use_cache=True`, Fast-dLLM's prefix cache): a block's first forward runs the whole
  canvas and keeps every layer's K/V of the positions before the block; the block's later forwards run only
  [block start, min(block end + further_horizon, canvas end)) against those cached K/V (`further_horizon`:
  AUTO_HORIZON = the family's official value, 128 LLaDA / 32 Dream; None = the rest of the canvas).
  Cheaper; approximate (cached keys/values were computed while the block was still masked, later positions
  past the horizon unseen), so replay differs a little (measured in the tests; TIS / MIS correct it).
Sequences of a batch are padded to the longest canvas (padding is invisible: `valid`); with the prefix
cache, sequences at a block's first forward and the others run as two forwards of one `run`. Each sequence
decodes as the official function decodes it alone, whatever else shares the batch (the official batched
rollouts left-pad prompts into one canvas and share one random stream, so a prompt's output there depends on
its batch-mates).
"""

from __future__ import annotations

import copy
from collections import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dllm.block_manager import KVBudget
from dllm.cache_mode import CACHE_MODES, DEFAULT_CACHE_MODE
from dllm.errors import FieldError
from dllm.full.model import KV, FullAttentionLM
from dllm.full.sampler import RANKINGS, RNGS, official_draws, sample_and_commit_full
from dllm.full.schedule import (
    AUTO_HORIZON,
    DREAM_EPS,
    family_schedule,
    resolve_horizon,
    schedule_name,
    window_end,
)
from dllm.full.step import FullStep
from dllm.intake import Intake
from dllm.logit_bias import bias_columns, biased_logits
from dllm.postprocess import Postprocessor, StepOutput, apply_step
from dllm.sampling import SamplingParams, counter_uniforms, needs_filter
from dllm.scheduler import S, ScheduledBatch
from dllm.sequence import Sequence, step_inputs
from dllm.step import columns
from dllm.strategy import Strategy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase



@dataclass
class FullState:
    """What the runner keeps per sequence (from its admission until it left) besides its `dllm.sequence.Sequence` (keyed by seq_id)."""

    canvas_len: int  # prompt + max_tokens to whole blocks (from the prompt's end): the length every forward sees
    past: list[KV] | None = None  # prefix cache: every layer's K/V [1, Hkv, past_len, D]
    past_len: int = -1  # the block start the cache was made for
    begun_block: int = -1  # the block start whose schedule is set
    gen: torch.Generator | None = None  # rng="official": the sequence's own torch generator


def canvas_len(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """Positions every forward of a sequence sees: the prompt, then max_tokens rounded up to whole blocks."""
    return prompt_len + -(-max_tokens // block_size) * block_size


def canvas(s: Sequence, length: int) -> list[int]:
    """The ids a forward sees now: the decoded prefix, the current block, masks up to `length`."""
    done = (s.prompt_ids + s.completion_ids)[:s.block_start]
    return done + s.block_ids + [s.mask_id] * (length - s.end_pos)


class FullRunner(Intake):
    """Runs scheduled batches of a FullAttentionLM (see the module docstring); BlockRunner's interface.

    `further_horizon`: prefix mode's window (AUTO_HORIZON: the family's official value; None: the rest of the
    canvas); `ranking`: "official" | "tempered" (dllm.full.sampler); `rng`: "counter" (dlrl's counter-based
    noise: batch- and device-invariant) | "official" (the official functions' torch draws, one generator per
    sequence: seeded rollouts bit-identical to theirs on the same device; W x V random numbers per forward);
    `pad_penalty`: Dream's pad_target_penalty; `eps`: Dream's timestep floor."""

    def __init__(self, model: FullAttentionLM, *, max_batch: int, max_len: int | None = None,
                 eos_ids: abc.Iterable[int] | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 cache_mode: str = DEFAULT_CACHE_MODE, further_horizon: int | None = AUTO_HORIZON, ranking: str = "official",
                 rng: str = "counter", pad_penalty: float = 1.0, eps: float = DREAM_EPS, compile: bool | str = False,
                 cuda_graphs: bool = False) -> None:
        if cache_mode not in CACHE_MODES:
            raise FieldError("cache_mode", f"unknown {cache_mode!r} (known: {', '.join(CACHE_MODES)})")
        if ranking not in RANKINGS:
            raise FieldError("ranking", f"unknown {ranking!r} (known: {', '.join(RANKINGS)})")
        if rng not in RNGS:
            raise FieldError("rng", f"unknown {rng!r} (known: {', '.join(RNGS)})")
        if not pad_penalty > 0:
            raise FieldError("pad_penalty", f"must be > 0, got {pad_penalty!r}")
        if not 0 < eps < 1:
            raise FieldError("eps", f"must be in (0, 1), got {eps!r}")
        if rng == "official" and (compile or cuda_graphs):
            raise FieldError("rng", "'official' (per-sequence torch generators, data-dependent draws) runs eagerly: "
                                    "it cannot be compiled or captured (use rng='counter' or compile=false)")
        try:
            horizon = resolve_horizon(model.family, further_horizon)
        except ValueError as e:
            raise FieldError("further_horizon", str(e).split(": ", 1)[1]) from None
        cfg = model.config
        self.model, self.tokenizer, self.cache_mode, self.pad_penalty = model, tokenizer, cache_mode, pad_penalty
        self.family, self.ranking, self.rng, self.eps = model.family, ranking, rng, eps
        self.further_horizon = horizon if cache_mode == "prefix" else None  # exact mode: the whole canvas
        self.vocab_size, self.block_size, self.mask_id = cfg.vocab_size, cfg.block_size, cfg.mask_token_id
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else -1
        self.shift = cfg.logit_shift
        self.eos_ids = list(cfg.eos_ids if eos_ids is None else eos_ids)
        limit = cfg.max_position_embeddings if max_len is None else max_len
        self.max_len = -(-limit // self.block_size) * self.block_size
        self.max_batch = max_batch
        self.kv_budget = KVBudget(max_batch)  # slots only: exact mode keeps no K/V, the prefix cache is per slot
        self.states: dict[int, FullState] = {}  # per admitted sequence (seq_id), until it left
        self.num_forwards = 0  # denoising forwards (model calls: a prefix-mode run may make two)
        self.static: FullStep | None = None  # the static-shape step (compile / cuda_graphs): dllm.full.step
        if compile or cuda_graphs:
            self.static = FullStep(model, max_batch=max_batch, max_len=self.max_len, cache_mode=cache_mode,
                                   further_horizon=self.further_horizon, ranking=ranking, pad_penalty=pad_penalty,
                                   compile=compile, cuda_graphs=cuda_graphs)

    @classmethod
    def for_prompts(cls, model: FullAttentionLM, prompts_ids: list[list[int]], params: list[SamplingParams], *,
                    tokenizer: PreTrainedTokenizerBase | None = None, eos_ids: abc.Iterable[int] | None = None,
                    cache_mode: str = DEFAULT_CACHE_MODE, further_horizon: int | None = AUTO_HORIZON, ranking: str = "official",
                    rng: str = "counter", pad_penalty: float = 1.0, compile: bool | str = False) -> FullRunner:
        """A runner sized for these prompts at once (standalone decoding): a slot each, the longest canvas."""
        B = model.config.block_size
        max_len = max(canvas_len(len(p), q.max_tokens, B) for p, q in zip(prompts_ids, params)) + B
        return cls(model, max_batch=len(prompts_ids), max_len=max_len, eos_ids=eos_ids, tokenizer=tokenizer,
                   cache_mode=cache_mode, further_horizon=further_horizon, ranking=ranking, rng=rng,
                   pad_penalty=pad_penalty, compile=compile)

    # ------------------------------------------------------------------ sequences in
    def postprocessor(self) -> Postprocessor:
        """The stop rules for the scheduler (its own tokenizer instance: the scheduler's thread only)."""
        tok = copy.deepcopy(self.tokenizer) if self.tokenizer is not None else None
        return Postprocessor(eos_ids=self.eos_ids, tokenizer=tok, max_len=self.max_len, block_size=self.block_size)

    def release(self, seqs: abc.Sequence[Sequence]) -> None:
        """Sequences that left (their slots already back in the block manager): drop their state."""
        for s in seqs:
            self.states.pop(s.seq_id, None)

    def _admit(self, seqs: abc.Sequence[Sequence]) -> None:
        """Sequences the scheduler admitted (slot given): blocks from the prompt's end, their state, the trace's
        cache fields. A sequence admitted again (never in slot-only scheduling) keeps its blocks."""
        for s in seqs:
            if s.seq_id in self.states:
                continue
            s.start_blocks_at(len(s.prompt_ids))
            n = canvas_len(len(s.prompt_ids), s.params.max_tokens, self.block_size)
            gen = None
            if self.rng == "official":
                gen = torch.Generator(device=self.model.device).manual_seed(s.seed)
            self.states[s.seq_id] = FullState(n, gen=gen)
            tr = s.trace
            tr.cache_mode, tr.canvas_len, tr.further_horizon = self.cache_mode, n, self.further_horizon
            tr.schedule = schedule_name(self.family, self.eps)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def run(self, batch: ScheduledBatch[S]) -> StepOutput:
        """One denoising forward for every sequence of `batch.running` (no post-processing): admitted ones
        are set up, a sequence whose block completed last time moves on first. Returns per sequence its block
        after the forward and whether its probabilities were finite (`seq.block_done`: for the Postprocessor)."""
        self._admit(batch.admitted)
        fs: list[Sequence] = list(batch.running)
        if not fs:
            return StepOutput([], 0)
        for s in fs:
            if s.seq_id not in self.states:
                raise KeyError(f"FullRunner.run: sequence {s.seq_id} was never admitted")
            if s.block_done:
                s.next_block(owe_cache=False)
            self._begin_block(s)
        before = sum(len(s.masked_positions()) for s in fs)
        whole = [self.cache_mode == "exact" or self.states[s.seq_id].past_len != s.block_start for s in fs]
        if self.static is not None:
            return apply_step(fs, self._static_run(fs, whole), self.block_size, self.mask_id, before)
        logits: list[torch.Tensor | None] = [None] * len(fs)
        for canvas_forward in (True, False):
            idx = [i for i, w in enumerate(whole) if w == canvas_forward]
            if idx:
                group = [fs[i] for i in idx]
                out = self._canvas_logits(group) if canvas_forward else self._window_logits(group)
                for i, row in zip(idx, out):
                    logits[i] = row
                self.num_forwards += 1
        block_logits = torch.stack([t for t in logits if t is not None])  # [N, B, V]
        rows = torch.from_numpy(self._pack(fs)).to(self.model.device)
        drawn, layout = None, None
        if self.rng == "official":
            layout = [self._official_layout(s, w) for s, w in zip(fs, whole)]
            drawn = self._official_draws(fs, biased_logits(block_logits, [s.params.logit_bias for s in fs]), layout)
        res = sample_and_commit_full(block_logits, rows, self.mask_id, any(needs_filter(s.params) for s in fs),
                                     family=self.family, ranking=self.ranking, pad_id=self.pad_id,
                                     pad_penalty=self.pad_penalty, drawn=drawn, topk_layout=layout).cpu()
        return apply_step(fs, res, self.block_size, self.mask_id, before)

    def _static_run(self, fs: list[Sequence], whole: list[bool]) -> torch.Tensor:
        """The forward, sampling and commit through the static-shape step (dllm.full.step): whole-canvas
        forwards (writing the prefix cache's slot) and window forwards, as two bucketed calls."""
        assert self.static is not None
        rows = self._pack(fs)
        filtered = any(needs_filter(s.params) for s in fs)
        out = torch.empty(len(fs), 3 * self.block_size + 1, dtype=torch.float64)
        for canvas_forward in (True, False):
            idx = [i for i, w in enumerate(whole) if w == canvas_forward]
            if not idx:
                continue
            group = [fs[i] for i in idx]
            states = [self.states[s.seq_id] for s in group]
            if canvas_forward:
                res = self.static.canvas([canvas(s, st.canvas_len) for s, st in zip(group, states)], rows[idx],
                                         filtered)
                for s, st in zip(group, states):
                    st.past_len = s.block_start  # prefix mode: the slot now holds this block's prefix cache
            else:
                ends = [window_end(s.end_pos, st.canvas_len, self.further_horizon) for s, st in zip(group, states)]
                wins = [canvas(s, st.canvas_len)[s.block_start:e] for s, st, e in zip(group, states, ends)]
                res = self.static.window(wins, rows[idx], [st.past_len for st in states], filtered)
            out[idx] = res.cpu()  # the one device-to-host copy of each call
            self.num_forwards += 1
        return out

    def _begin_block(self, s: Sequence) -> None:
        """A block's first forward: the family's static schedule for it (every block starts fully masked)."""
        st = self.states[s.seq_id]
        if st.begun_block != s.block_start:
            st.begun_block = s.block_start
            s.schedule = family_schedule(self.family, len(s.masked_positions()), s.params.steps or self.block_size,
                                         self.eps)

    def _pack(self, seqs: list[Sequence]) -> np.ndarray:
        """dllm.step's row layout per sequence (block, step fields, sampling parameters, uniforms); Dream's
        first forward of a block commits the block's first position only (sequential, k = 1)."""
        B = self.block_size
        rows = np.array([step_inputs(s) for s in seqs], dtype=np.float64)
        col = columns(B)
        for r, s in enumerate(seqs):
            if self.family == "dream" and s.step_in_block == 0:
                rows[r, col["k"]], rows[r, col["strategy"]] = 1, Strategy.sequential.code
        noise = counter_uniforms([s.seed for s in seqs], rows[:, col["block_start"], None] + np.arange(B),
                                 rows[:, col["step"]])
        return np.concatenate([rows, noise, bias_columns([s.params.logit_bias for s in seqs])], axis=1)

    def _official_layout(self, s: Sequence, whole: bool) -> tuple[int, int]:
        """(width, offset): the positions of the official function's logits at this forward and where the block
        sits in them -- the whole canvas at a block's first forward, the window of a prefix-cache forward, and
        from the block on for exact mode's later forwards (the official code slices `logits[:, s:]`)."""
        st = self.states[s.seq_id]
        if not whole:
            return window_end(s.end_pos, st.canvas_len, self.further_horizon) - s.block_start, 0
        if s.step_in_block == 0:
            return st.canvas_len, s.block_start
        return st.canvas_len - s.block_start, 0

    def _official_draws(self, seqs: list[Sequence], logits: torch.Tensor,
                        layout: list[tuple[int, int]]) -> torch.Tensor:
        """rng="official": each sampled sequence's tokens from its own generator, drawn as the official function
        draws them for that forward (dllm.full.sampler.official_draws); greedy rows draw nothing."""
        drawn = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
        for r, (s, (width, offset)) in enumerate(zip(seqs, layout)):
            gen = self.states[s.seq_id].gen
            if s.params.is_greedy or gen is None:
                continue
            drawn[r] = official_draws(self.family, logits[r], s.params, self.mask_id, gen, width=width,
                                      offset=offset, masked=s.masked_positions(), first=s.step_in_block == 0)
        return drawn

    def _block_rows(self, hidden: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """hidden [N, L, D], the block's first index per row -> logits of the block's positions [N, B, V]
        (Dream: from the hidden state one position earlier; index 0 keeps its own, as the official shift)."""
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

    def _window_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Prefix cache: only [block start, window end) runs, attending to the cached K/V before it."""
        dev = self.model.device
        states = [self.states[s.seq_id] for s in seqs]
        ends = [window_end(s.end_pos, st.canvas_len, self.further_horizon) for s, st in zip(seqs, states)]
        P = max(st.past_len for st in states)
        W = max(e - s.block_start for s, e in zip(seqs, ends))
        ids = torch.full((len(seqs), W), self.mask_id, dtype=torch.long)
        valid = torch.zeros(len(seqs), W, dtype=torch.bool)
        pos = torch.zeros(len(seqs), W, dtype=torch.long)
        past_valid = torch.zeros(len(seqs), P, dtype=torch.bool)
        for r, (s, st, end) in enumerate(zip(seqs, states, ends)):
            win = canvas(s, st.canvas_len)[s.block_start:end]
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


    def close(self) -> None:
        self.states.clear()
        if self.static is not None:
            self.static.cache = None
