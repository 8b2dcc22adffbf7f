"""The static-shape full-attention decode step (LLaDA, Dream): canvases padded to buckets, each bucket compiled
once (torch.compile) and optionally captured as a CUDA graph; both cache modes.

    step = FullStep(model, max_batch=16, max_len=4096, cache_mode="prefix", further_horizon=32, family="dream",
                    compile=True, cuda_graphs=False)        # FullRunner(..., compile=..., cuda_graphs=...) makes it
    out = step.canvas(canvases, rows, filtered)             # whole-canvas forwards -> [n, 3B + 1] on the device
    out = step.window(windows, rows, past_lens, filtered)   # prefix cache: a block's later forwards
    step.warmup()                                           # every bucket key once: nothing compiles later

A forward's inputs -- the canvas (or window) ids, dllm.step's packed row (block, step fields, sampling
parameters, uniforms) and the lengths -- are packed on the host into the bucket's preallocated float64 buffer
with one copy; the step then runs with no host synchronisation and no data-dependent shape: positions and the
bidirectional mask come from the lengths, Dream's shift and the block's logits are a gather, sampling and the
commit rules (dllm.full.sampler, counter noise) are tensor ops on every row. Buckets: rows 1, 2, 4, ...
`max_batch`; canvas lengths B, 2B, 4B, ... (B the block size) up to `max_len` + B; for the prefix cache, past
lengths likewise and window widths B, 2B, ... up to B + `further_horizon`. Padding rows and positions are
invalid keys nobody sees (a padding row reads and writes the scratch slot of the cache).

Prefix cache (`cache_mode="prefix"`): one preallocated K/V buffer per layer, [max_batch + 1, Hkv, max_len + B, D]
(the last slot: scratch); a canvas forward writes its rows' K/V at their slots, a window forward reads a past
bucket of them (positions before the block valid). Weight updates copy into the parameters in place, so neither
the compiled code nor the graphs go stale. With `compile` (True: inductor; a string: that backend, the tests use
"eager") each key (rows, length[s], filtered) gets one graph with static shapes. `cuda_graphs` (CUDA only)
captures each key's step once and replays it (dllm.cuda_graphs.GraphedSteps). rng="official" (per-sequence
torch generators) is eager only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from dllm.cache_mode import DEFAULT_CACHE_MODE
from dllm.full.model import FullAttentionLM
from dllm.full.sampler import sample_and_commit_full
from dllm.step import buckets, columns, padding_row, width

if TYPE_CHECKING:
    from dllm.cuda_graphs import GraphedSteps

log = logging.getLogger("dlrl.dllm")


def block_logits(model: FullAttentionLM, hidden: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """hidden [R, L, D], the block's first index per row [R] -> the block's logits [R, B, V] (Dream: from the
    hidden state one position earlier, index 0 its own)."""
    B, shift = model.config.block_size, model.config.logit_shift
    idx = (start[:, None] + torch.arange(B, device=hidden.device) - shift).clamp(min=0)  # [R, B]
    return model.head(hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1])))


def canvas_step(model: FullAttentionLM, cache: list[torch.Tensor] | None, buf: torch.Tensor, filtered: bool,
                family: str, ranking: str, pad_id: int, pad_penalty: float) -> torch.Tensor:
    """buf [R, L + width(B) + 1]: canvas ids, packed row, canvas length -> [R, 3B + 1]. With a cache, every
    row's K/V of the L positions go to its slot (the prefix cache of the block it starts)."""
    B, mask_id = model.config.block_size, model.config.mask_token_id
    col, f = columns(B), width(B)
    L = buf.shape[1] - f - 1
    ids, rows, n = buf[:, :L].long(), buf[:, L:L + f], buf[:, -1].long()
    pos = torch.arange(L, device=buf.device).expand(ids.shape[0], L)
    hidden, kv = model.hidden_states(ids, pos, pos < n[:, None], keep_kv=cache is not None, attention="sdpa")
    if cache is not None and kv is not None:
        slot = rows[:, col["slot"]].long()
        for i, (k, v) in enumerate(kv):
            cache[2 * i][slot, :, :L] = k
            cache[2 * i + 1][slot, :, :L] = v
    logits = block_logits(model, hidden, rows[:, col["block_start"]].long())
    return sample_and_commit_full(logits, rows, mask_id, filtered, family=family, ranking=ranking, pad_id=pad_id,
                                  pad_penalty=pad_penalty)


def window_step(model: FullAttentionLM, cache: list[torch.Tensor], buf: torch.Tensor, past_pos: torch.Tensor,
                filtered: bool, family: str, ranking: str, pad_id: int, pad_penalty: float) -> torch.Tensor:
    """buf [R, W + width(B) + 2]: window ids (from the block start), packed row, window length, past length;
    past_pos [P] (the past bucket) -> [R, 3B + 1]: the window against its slot's cached K/V before the block."""
    B, mask_id = model.config.block_size, model.config.mask_token_id
    col, f = columns(B), width(B)
    W, P = buf.shape[1] - f - 2, past_pos.shape[0]
    ids, rows = buf[:, :W].long(), buf[:, W:W + f]
    n, past_len = buf[:, -2].long(), buf[:, -1].long()
    start, slot = rows[:, col["block_start"]].long(), rows[:, col["slot"]].long()
    offsets = torch.arange(W, device=buf.device)
    pos = start[:, None] + offsets
    past = [(cache[2 * i][slot, :, :P], cache[2 * i + 1][slot, :, :P]) for i in range(len(cache) // 2)]
    hidden, _ = model.hidden_states(ids, pos, offsets < n[:, None], past=past,
                                    past_valid=past_pos < past_len[:, None], attention="sdpa")
    logits = block_logits(model, hidden, torch.zeros_like(start))
    return sample_and_commit_full(logits, rows, mask_id, filtered, family=family, ranking=ranking, pad_id=pad_id,
                                  pad_penalty=pad_penalty)


class FullStep:
    """Bucketed inputs in preallocated buffers -> `canvas_step` / `window_step` (eager, compiled, graph-replayed)."""

    def __init__(self, model: FullAttentionLM, *, max_batch: int, max_len: int, cache_mode: str = DEFAULT_CACHE_MODE,
                 further_horizon: int | None = None, ranking: str = "official", pad_penalty: float = 1.0,
                 compile: bool | str = False, cuda_graphs: bool = False, max_graphs: int = 256) -> None:
        cfg = model.config
        self.model, self.cache_mode, self.max_batch = model, cache_mode, max_batch
        B, dev = cfg.block_size, model.device
        self.block_size = B
        self.consts = (model.family, ranking, cfg.pad_token_id if cfg.pad_token_id is not None else -1, pad_penalty)
        limit = -(-max_len // B) * B + B  # a canvas may pass max_len by less than a block
        self.row_buckets = buckets(max_batch)
        self.len_buckets = [B * b for b in buckets(limit // B)]
        widest = limit if further_horizon is None else min(limit, B + further_horizon)
        self.win_buckets = [B * b for b in buckets(-(-widest // B))]
        self.further_horizon = further_horizon
        self._pad = padding_row(B, cfg.mask_token_id)
        self._pad[columns(B)["slot"]] = max_batch  # the scratch slot
        self._bufs: dict[tuple[str, int, int], torch.Tensor] = {}
        self._past_pos = {P: torch.arange(P, device=dev) for P in self.len_buckets}
        self.cache: list[torch.Tensor] | None = None
        if cache_mode == "prefix":
            shape = (max_batch + 1, cfg.num_key_value_heads, limit, cfg.head_dim)
            self.cache = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(2 * cfg.num_hidden_layers)]
        self.compiled = bool(compile)
        self.canvas_fn: Callable[..., torch.Tensor] = canvas_step
        self.window_fn: Callable[..., torch.Tensor] = window_step
        if compile:
            backend = "inductor" if compile is True else compile
            self.canvas_fn = torch.compile(canvas_step, fullgraph=True, backend=backend, dynamic=False)
            self.window_fn = torch.compile(window_step, fullgraph=True, backend=backend, dynamic=False)
            dyn = torch._dynamo.config
            keys = len(self.keys())
            dyn.recompile_limit = max(dyn.recompile_limit, keys)
            dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 2 * keys)
        self.graphs: dict[str, GraphedSteps] | None = None
        if cuda_graphs:
            from dllm.cuda_graphs import GraphedSteps

            self.graphs = {"canvas": GraphedSteps(self.canvas_fn, max_graphs),
                           "window": GraphedSteps(self.window_fn, max_graphs)}
        log.info("full-attention step: %s, %s cache, row buckets %s, canvas buckets %s%s",
                 "compiled, static shapes" if compile else "eager, static shapes", cache_mode, self.row_buckets,
                 self.len_buckets, f", window buckets {self.win_buckets}" if self.cache is not None else "")

    def keys(self, filtered: Sequence[bool] = (False, True)) -> list[tuple]:
        """Every bucket key a step can meet: ("canvas", rows, length, filtered) and, with the prefix cache,
        ("window", rows, past length, window width, filtered)."""
        out: list[tuple] = [("canvas", R, L, f) for R in self.row_buckets for L in self.len_buckets for f in filtered]
        if self.cache is not None:
            out += [("window", R, P, W, f) for R in self.row_buckets for P in self.len_buckets
                    for W in self.win_buckets for f in filtered]
        return out

    @torch.no_grad()
    def warmup(self, filtered: Sequence[bool] = (False, True)) -> int:
        """Run every bucket key once on padding rows (they touch only the scratch slot): each compiled /
        captured before traffic, so none compiles later. Returns the keys run."""
        keys = self.keys(filtered)
        for key in keys:
            R, f = key[1], key[-1]
            pads = np.tile(self._pad, (R, 1))
            if key[0] == "canvas":
                self._canvas(np.full((R, key[2]), self._pad[0]), pads, np.ones(R), key[2], f)
            else:
                self._window(np.full((R, key[3]), self._pad[0]), pads, np.ones(R), np.zeros(R), key[2], key[3], f)
        return len(keys)

    def bucket(self, values: Sequence[int], n: int) -> int:
        return next(v for v in values if v >= n)

    def _buffer(self, kind: str, R: int, cols: int) -> torch.Tensor:
        buf = self._bufs.get((kind, R, cols))
        if buf is None:
            buf = self._bufs[kind, R, cols] = torch.empty(R, cols, dtype=torch.float64, device=self.model.device)
        return buf

    def _call(self, kind: str, key: tuple, args: tuple) -> torch.Tensor:
        fn = self.canvas_fn if kind == "canvas" else self.window_fn
        if self.graphs is not None:
            return self.graphs[kind].run(key, args)
        return fn(*args)

    @torch.no_grad()
    def canvas(self, canvases: list[list[int]], rows: np.ndarray, filtered: bool) -> torch.Tensor:
        """Whole-canvas forwards: each row's canvas ids (its length valid), its packed row -> [n, 3B + 1]."""
        n = len(canvases)
        R, L = self.bucket(self.row_buckets, n), self.bucket(self.len_buckets, max(map(len, canvases)))
        ids = np.full((R, L), self._pad[0])
        for r, c in enumerate(canvases):
            ids[r, :len(c)] = c
        lens = np.ones(R)
        lens[:n] = [len(c) for c in canvases]
        return self._canvas(ids, self._rows(rows, R), lens, L, filtered)[:n]

    @torch.no_grad()
    def window(self, windows: list[list[int]], rows: np.ndarray, past_lens: list[int], filtered: bool) -> torch.Tensor:
        """A block's later forwards with the prefix cache: each row's window ids (from the block start) and the
        length of its cached past -> [n, 3B + 1]."""
        n = len(windows)
        R = self.bucket(self.row_buckets, n)
        W = self.bucket(self.win_buckets, max(map(len, windows)))
        P = self.bucket(self.len_buckets, max(past_lens))
        ids = np.full((R, W), self._pad[0])
        for r, w in enumerate(windows):
            ids[r, :len(w)] = w
        lens, past = np.ones(R), np.zeros(R)
        lens[:n], past[:n] = [len(w) for w in windows], past_lens
        return self._window(ids, self._rows(rows, R), lens, past, P, W, filtered)[:n]

    def _rows(self, rows: np.ndarray, R: int) -> np.ndarray:
        out = np.tile(self._pad, (R, 1))
        out[:rows.shape[0]] = rows
        return out

    def _canvas(self, ids: np.ndarray, rows: np.ndarray, lens: np.ndarray, L: int, filtered: bool) -> torch.Tensor:
        host = np.concatenate([ids, rows, lens[:, None]], 1)
        buf = self._buffer("canvas", host.shape[0], host.shape[1])
        buf.copy_(torch.from_numpy(host), non_blocking=True)  # the one host-to-device copy
        args = (self.model, self.cache, buf, filtered, *self.consts)
        return self._call("canvas", ("canvas", host.shape[0], L, filtered), args)

    def _window(self, ids: np.ndarray, rows: np.ndarray, lens: np.ndarray, past: np.ndarray, P: int, W: int,
                filtered: bool) -> torch.Tensor:
        assert self.cache is not None, "FullStep.window: the prefix cache mode only"
        host = np.concatenate([ids, rows, lens[:, None], past[:, None]], 1)
        buf = self._buffer("window", host.shape[0], host.shape[1])
        buf.copy_(torch.from_numpy(host), non_blocking=True)
        args = (self.model, self.cache, buf, self._past_pos[P], filtered, *self.consts)
        return self._call("window", ("window", host.shape[0], P, W, filtered), args)
