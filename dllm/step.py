"""The static decode step: one denoising forward + sampling + commit, with bucketed shapes, on the device.

    step = DecodeStep(model, cache, max_rows=2 * max_batch, compile=False, cuda_graphs=False)
    out = step.run(rows, num_out, kv_len, filtered)   # rows: numpy [n, width(B)] -> [num_out, 3B + 1] on the device

The forward's rows -- the blocks being denoised, then the clean blocks owed to the cache
(a just-finished block, a one-block prompt) -- are padded to a row bucket (1, 2, 4, ...,
`max_rows`) and the keys to a page-aligned bucket (1, 2, 4, ... pages: powers of two whatever
the cache's `max_len`, so a sequence's logprobs do not depend on it; keys past a row's own
block are masked). The packed rows go into the bucket's preallocated device buffer with one
copy; `decode_step` then runs with no host synchronisation and no data-dependent shape: the
mask, positions and cache addressing are built once (not per layer), every layer writes its
K/V once, sampling (`sample_static`) and the commit rules (`commit_mask`, all strategies)
are tensor ops on every row. Only the sequences' rows (the first `num_out`, padded to their
own row bucket) go through the vocabulary projection and the sampler. Padding
rows write into the cache's scratch page and no real row attends to them; their outputs,
like those of the clean rows, are never read. The caller does the one device-to-host copy.

`compile=True` runs `torch.compile(decode_step, fullgraph=True)` (a string: that backend;
the tests trace with "eager"). With `static_shapes=True` (the default) every bucket key (rows,
sampled rows, keys, filtered: top-k / top-p used by some row or not) gets its own graph with
static shapes, compiled the first time the key is met or up front by `warmup()`: after it, no
recompilation whatever the batch or positions (static shapes are what inductor's Triton codegen
handles best, and CUDA graphs capture per bucket anyway). With `static_shapes=False` the row and
key dims are marked dynamic, so one graph serves every bucket (plus the one-row buckets, which
torch specialises, and the `filtered` variants) -- at most 6 compilations, then none.
`attention`: the kernel of the step's attention over the cache, "sdpa", "flash" (flash-attn's
`flash_attn_with_kvcache`, CUDA fp16/bf16: `dllm.attention.flash_decode`) or "auto" (flash where it
can run). `cuda_graphs=True` (CUDA only) captures each bucket's step once
and replays it (`dllm.cuda_graphs`). Weight updates copy into the parameters in place
(`dllm.weights.copy_into_model`), so neither the compiled code nor the graphs go stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from dllm.attention import MaskSpec, decode_backend
from dllm.commit import commit_mask
from dllm.kv_cache import KVCache
from dllm.model import SDARForCausalLM
from dllm.sampling import PARAM_FIELDS, sample_static

log = logging.getLogger("dlrl.dllm")
FIELDS = ("block_start", "step", "k", "strategy", "threshold", "slot", "write", *PARAM_FIELDS)
# row layout: block ids, steps, logprobs [3B] | FIELDS | sampling uniforms [B]


def columns(block_size: int) -> dict[str, int]:
    """Column of each FIELDS value in a packed row (the block and the uniforms around them)."""
    return {name: 3 * block_size + i for i, name in enumerate(FIELDS)}


def width(block_size: int) -> int:
    return 4 * block_size + len(FIELDS)


def buckets(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit` (included)."""
    out = [1]
    while out[-1] < limit:
        out.append(min(2 * out[-1], limit))
    return out


def padding_row(block_size: int, mask_id: int) -> np.ndarray:
    """A row that writes only into the scratch page and is never read (greedy, no commit)."""
    row = np.zeros(width(block_size))
    col = columns(block_size)
    row[:block_size] = mask_id
    row[[col["step"], col["temperature"], col["top_p"], col["greedy"]]] = 1.0
    row[3 * block_size + len(FIELDS):] = 0.5
    return row


def sample_and_commit(logits: torch.Tensor, rows: torch.Tensor, mask_id: int, filtered: bool) -> torch.Tensor:
    """logits: [R, B, V], rows: [R, width(B)] -> [R, 3B + 1] float64: the new block ids, steps, logprobs
    and whether the row's probabilities were finite (1.0) -- every row the same ops, on the device."""
    R, B = logits.shape[:2]
    col, f = columns(B), 3 * B + len(FIELDS)
    params = rows[:, col[PARAM_FIELDS[0]]:col[PARAM_FIELDS[-1]] + 1]  # [R, 4]
    tok, lp = sample_static(logits, params, rows[:, f:f + B], mask_id, filtered)  # [R, B] each
    masked = rows[:, :B] == mask_id
    is_ok = (torch.isfinite(lp) | ~masked).all(-1)  # [R]
    commit = commit_mask(lp.exp(), masked, rows[:, col["k"]].long(), rows[:, col["threshold"]].float(),
                         rows[:, col["strategy"]].long()) & is_ok[:, None]
    step = rows[:, col["step"], None].expand(R, B)
    new = torch.stack([tok.double(), step, lp.double()], 1)  # [R, 3, B]: ids, steps, logprobs
    block = torch.where(commit[:, None], new, rows[:, :3 * B].reshape(R, 3, B))
    return torch.cat([block.reshape(R, 3 * B), is_ok[:, None].double()], 1)


def decode_step(model: SDARForCausalLM, cache: KVCache, rows: torch.Tensor, k_pos: torch.Tensor, out_rows: torch.Tensor,
                filtered: bool, attention: str = "sdpa") -> torch.Tensor:
    """rows: [R, width(B)] packed inputs, k_pos: [KV] key positions (the bucket), out_rows: [Rn] (its length
    is the row bucket of the sequences: rows [0, Rn) are sampled) -> [Rn, 3B + 1]. attention: "sdpa" or
    "flash" (the cache attention's kernel)."""
    B, mask_id = model.config.block_size, model.config.mask_token_id
    col = columns(B)
    R, KV, Rn = rows.shape[0], k_pos.shape[0], out_rows.shape[0]
    ids = rows[:, :B].long()  # [R, B]
    pos = rows[:, col["block_start"], None].long() + torch.arange(B, device=rows.device)  # [R, B]
    write = (rows[:, col["write"], None] > 0).expand(R, B)
    kp = k_pos.expand(R, KV)
    spec = MaskSpec(pos, kp, B, k_valid=kp <= pos[:, -1:], backend=attention)  # keys past a row's block: stale
    view = cache.view(rows[:, col["slot"]].long(), pos, k_pos, write)
    logits = model.lm_head(model.hidden_states(ids, spec, view)[:Rn])  # [Rn, B, V]: the sequences' rows
    return sample_and_commit(logits, rows[:Rn], mask_id, filtered)


class DecodeStep:
    """Bucketed inputs in preallocated buffers -> `decode_step` (eager, compiled or graph-replayed)."""

    def __init__(self, model: SDARForCausalLM, cache: KVCache | None, *, max_rows: int, compile: bool | str = False,
                 cuda_graphs: bool = False, max_graphs: int = 64, static_shapes: bool = True,
                 attention: str = "auto", max_sampled: int | None = None) -> None:
        if cache is None:
            raise ValueError("cache: the decode step runs on a KV cache")
        self.model, self.cache = model, cache
        B, dev = model.config.block_size, model.device
        self.row_buckets = buckets(max_rows)
        self.max_sampled = max_rows if max_sampled is None else max_sampled  # sequences per step (<= rows)
        self.kv_buckets = [p * cache.page_size for p in buckets(cache.table_pages)]  # powers of two
        self._pad = padding_row(B, model.config.mask_token_id)
        self._rows = {R: torch.empty(R, width(B), dtype=torch.float64, device=dev) for R in self.row_buckets}
        self._k_pos = {KV: torch.arange(KV, device=dev) for KV in self.kv_buckets}
        self._out = {R: torch.arange(R, device=dev) for R in self.row_buckets}
        model.norms_on(dev)  # lazy state made now: a compiled graph guards on it
        self.attention = decode_backend(attention, dev, model.dtype, model.config.head_dim)
        self.fn: Callable[..., torch.Tensor] = decode_step
        self.static_shapes = bool(compile) and static_shapes
        if compile:
            backend = "inductor" if compile is True else compile  # a name: tests trace with "eager"
            self.fn = torch.compile(decode_step, fullgraph=True, backend=backend, dynamic=False if static_shapes else None)
            cfg = torch._dynamo.config
            if static_shapes:  # one graph per bucket key: the limits must hold them all
                keys = len(self.keys())
                cfg.recompile_limit = max(cfg.recompile_limit, keys)
                cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 2 * keys)
            else:  # variants: 1 row or more, 1 sampled row or more, filtered or not (torch's default limit: 8)
                cfg.recompile_limit = max(cfg.recompile_limit, 16)
                for t in (*self._rows.values(), *self._k_pos.values(), *self._out.values()):
                    if t.shape[0] > 1:  # one compiled graph for every bucket (torch specialises size 1)
                        torch._dynamo.maybe_mark_dynamic(t, 0)
        self.graphs = None
        if cuda_graphs:
            from dllm.cuda_graphs import GraphedSteps

            self.graphs = GraphedSteps(self.fn, max_graphs)
        log.info("decode step: %s, attention %s, row buckets %s, key buckets %s",
                 ("compiled, static shapes" if self.static_shapes else "compiled") if compile else "eager",
                 self.attention, self.row_buckets, self.kv_buckets)

    def keys(self, max_kv: int | None = None, filtered: tuple[bool, ...] = (False, True)) -> list[tuple[int, int, int, bool]]:
        """Every bucket key (rows, sampled rows, keys, filtered) a step can meet (keys up to `max_kv`)."""
        kvs = [k for k in self.kv_buckets if max_kv is None or k <= self.bucket(1, max_kv)[1]]
        sampled = [r for r in self.row_buckets if r <= self.bucket(self.max_sampled, 1)[0]]
        return [(R, Rn, KV, f) for R in self.row_buckets for Rn in sampled if Rn <= R for KV in kvs for f in filtered]

    def warmup(self, max_kv: int | None = None, filtered: tuple[bool, ...] = (False, True)) -> int:
        """Run every bucket key's step once on padding rows (they write only the scratch page): each
        compiled / captured before traffic, so none compiles later. Returns the keys run."""
        keys = self.keys(max_kv, filtered)
        for R, Rn, KV, f in keys:
            self.run(np.tile(self._pad, (R, 1)), Rn, KV, f)
        return len(keys)

    def bucket(self, num_rows: int, kv_len: int) -> tuple[int, int]:
        return (next(r for r in self.row_buckets if r >= num_rows), next(k for k in self.kv_buckets if k >= kv_len))

    @torch.no_grad()
    def run(self, rows: np.ndarray, num_out: int, kv_len: int, filtered: bool) -> torch.Tensor:
        """rows: [n, width(B)] packed (numpy), the first `num_out` sampled; kv_len: the longest row's end
        -> [num_out, 3B + 1] on the device."""
        n = rows.shape[0]
        R, KV = self.bucket(n, kv_len)
        Rn = self.bucket(num_out, kv_len)[0]
        host = np.empty((R, rows.shape[1]))
        host[:n], host[n:] = rows, self._pad
        buf, k_pos, out_rows = self._rows[R], self._k_pos[KV], self._out[Rn]
        buf.copy_(torch.from_numpy(host), non_blocking=True)  # the one host-to-device copy
        args = (self.model, self.cache, buf, k_pos, out_rows, filtered, self.attention)
        out = self.graphs.run((R, Rn, KV, filtered), args) if self.graphs is not None else self.fn(*args)
        return out[:num_out]
