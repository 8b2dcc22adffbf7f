"""The host side of a step: its typed inputs packed into one buffer (ONE host-to-device copy), its results read
back (ONE device-to-host copy).

    bufs = StepBuffers(block_size=4, device=dev, max_rows=32, max_sampled=16, max_pages=64)
    x = pack(bufs, seqs, owed, tables, R=8, Rn=4, P=16, mask_id=63)   # dllm.step.StepInputs (device views)
    bufs.upload(8, 4, 16)                   # host -> device, one copy of the bucket's bytes (none on CPU)
    ids, logprobs, committed, ok = read_back(result, n)   # the first n rows of a StepResult, as lists

`pack` writes every field of the bucket: the sequences' blocks and sampling parameters (their noise:
dllm.sampling.counter_uniforms; their logit_bias as (ids, values) padded to dllm.logit_bias.MAX_ENTRIES,
the same width for every row and bucket, so a bias never changes a compiled step's shapes), the clean blocks owed to the cache, each row's page table (a row of
the block manager's `tables`, by slot), padding rows (greedy, writing into the scratch page).

Each bucket (rows R, sampled rows Rn, pages of keys P) lays its fields out back to back (8-byte
types first, booleans last: every field aligned) from byte 0 of the buffer; its views are made
once and reused, so the compiled step and a captured CUDA graph always read the same storage.
On CUDA the host buffer is pinned and the copy is asynchronous (the step's one device-to-host
copy of its results, after the forward, orders it); on CPU the host views are the device buffer.
"""

from __future__ import annotations

from collections import abc

import numpy as np
import torch

from dllm.logit_bias import MAX_ENTRIES, padded
from dllm.sampling import counter_uniforms
from dllm.sequence import Sequence
from dllm.step import StepInputs, StepResult
from dllm.strategy import Strategy

# (field, dtype, rows: "R" | "Rn", columns: "B" | "P" | "K" | None), in layout order
LAYOUT = (("ids", torch.int64, "R", "B"), ("block_start", torch.int64, "R", None),
          ("page_table", torch.int64, "R", "P"), ("k", torch.int64, "Rn", None), ("strategy", torch.int64, "Rn", None),
          ("top_k", torch.int64, "Rn", None), ("threshold", torch.float64, "Rn", None),
          ("temperature", torch.float64, "Rn", None), ("top_p", torch.float64, "Rn", None),
          ("uniforms", torch.float64, "Rn", "B"), ("bias_ids", torch.int64, "Rn", "K"),
          ("bias_values", torch.float64, "Rn", "K"), ("write", torch.bool, "R", None), ("greedy", torch.bool, "Rn", None))
_NUMPY = {torch.int64: np.int64, torch.float64: np.float64, torch.bool: np.bool_}
assert {f for f, *_ in LAYOUT} == set(StepInputs._fields), "LAYOUT: every field of StepInputs, once"


def _shapes(R: int, Rn: int, P: int, B: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    dims = {"R": R, "Rn": Rn, "B": B, "P": P, "K": MAX_ENTRIES}
    return [(name, dt, (dims[rows],) if cols is None else (dims[rows], dims[cols])) for name, dt, rows, cols in LAYOUT]


def num_bytes(R: int, Rn: int, P: int, B: int) -> int:
    return sum(int(np.prod(shape)) * torch.empty((), dtype=dt).element_size() for _, dt, shape in _shapes(R, Rn, P, B))


class StepBuffers:
    def __init__(self, block_size: int, device: torch.device, *, max_rows: int, max_sampled: int,
                 max_pages: int) -> None:
        self.block_size, self.device = block_size, device
        size = num_bytes(max_rows, max_sampled, max_pages, block_size)
        self.device_buf = torch.zeros(size, dtype=torch.uint8, device=device)
        self.host_buf = (self.device_buf if device.type == "cpu"
                         else torch.zeros(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available()))
        self._host = self.host_buf.numpy()
        self._views: dict[tuple[int, int, int], tuple[dict[str, np.ndarray], StepInputs, int]] = {}

    def get(self, R: int, Rn: int, P: int) -> tuple[dict[str, np.ndarray], StepInputs]:
        """The bucket's host views (to fill) and device views (the step's inputs)."""
        entry = self._views.get((R, Rn, P))
        if entry is None:
            entry = self._views[(R, Rn, P)] = self._make(R, Rn, P)
        return entry[0], entry[1]

    def upload(self, R: int, Rn: int, P: int) -> None:
        """The bucket's bytes host -> device (nothing to do on CPU)."""
        if self.host_buf is not self.device_buf:
            n = self._views[(R, Rn, P)][2]
            self.device_buf[:n].copy_(self.host_buf[:n], non_blocking=True)

    def _make(self, R: int, Rn: int, P: int) -> tuple[dict[str, np.ndarray], StepInputs, int]:
        host: dict[str, np.ndarray] = {}
        dev: dict[str, torch.Tensor] = {}
        at = 0
        for name, dt, shape in _shapes(R, Rn, P, self.block_size):
            n = int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
            host[name] = self._host[at:at + n].view(_NUMPY[dt]).reshape(shape)
            dev[name] = self.device_buf[at:at + n].view(dt).view(shape)
            at += n
        return host, StepInputs(**dev), at


# a padding row's sampling parameters (greedy, commits nothing)
_PAD = {"k": 0, "strategy": 0, "threshold": 0.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "greedy": True}
_CODES = {str(s): s.code for s in Strategy}  # a plain dict lookup: Strategy(...) per row per step costs more


def pack(bufs: StepBuffers, seqs: abc.Sequence[Sequence], owed: abc.Sequence[Sequence], tables: np.ndarray | None,
         R: int, Rn: int, P: int, mask_id: int) -> StepInputs:
    """The bucket's typed inputs: rows = the sequences' blocks (the first N, sampled), the clean blocks they
    owe the cache (`seq.pending`, one block each), padding; `tables`: page tables by slot (None: no cache)."""
    N, B = len(seqs), bufs.block_size
    n = N + len(owed)
    h, x = bufs.get(R, Rn, P)
    if seqs:  # none: warmup's padding-only bucket (numpy cannot broadcast [] into [0, B])
        h["ids"][:N] = [s.block_ids for s in seqs]
        h["block_start"][:N] = [s.block_start for s in seqs]
    if owed:
        h["ids"][N:n] = [s.pending for s in owed]
        h["block_start"][N:n] = [s.block_start - B for s in owed]
    h["ids"][n:], h["block_start"][n:] = mask_id, 0
    h["write"][:n], h["write"][n:] = True, False
    table = h["page_table"]
    if tables is None:
        table[:] = 0
    else:
        w = min(P, tables.shape[1])
        table[:n, :w] = tables[slots_of([*seqs, *owed]), :w]
        table[:n, w:], table[n:] = 0, 0
    params = np.array([_param_row(s) for s in seqs], dtype=np.float64).reshape(N, len(_PAD))  # [N, 7]
    for j, name in enumerate(_PAD):
        h[name][:N], h[name][N:] = params[:, j], _PAD[name]
    steps = np.array([s.step_in_block + 1 for s in seqs], dtype=np.int64)
    h["uniforms"][:N] = counter_uniforms([s.seed for s in seqs], h["block_start"][:N, None] + np.arange(B), steps)
    h["uniforms"][N:] = 0.5
    h["bias_ids"][:], h["bias_values"][:] = 0, 0.0
    for r, s in enumerate(seqs):
        if s.params.logit_bias:
            h["bias_ids"][r], h["bias_values"][r] = padded(s.params.logit_bias)
    return x


def read_back(res: StepResult, n: int) -> tuple[list, list, list, list]:
    """(ids, logprobs, committed, ok) of the first n rows, as lists: off the CPU, one copy of all four as bytes."""
    if res.ids.device.type == "cpu":
        return res.ids[:n].tolist(), res.logprobs[:n].tolist(), res.committed[:n].tolist(), res.ok[:n].tolist()
    return from_bytes(as_bytes(res, n).cpu().numpy(), res.ids.shape[1])


def as_bytes(res: StepResult, n: int) -> torch.Tensor:
    """The first n rows of a step's results as one [n, 13 B + 1] uint8 tensor (on their device)."""
    return torch.cat([res.ids[:n].contiguous().view(torch.uint8), res.logprobs[:n].contiguous().view(torch.uint8),
                      res.committed[:n].view(torch.uint8), res.ok[:n, None].view(torch.uint8)], 1)


def from_bytes(raw: np.ndarray, B: int) -> tuple[list, list, list, list]:
    """`as_bytes`' rows (on the host) -> (ids, logprobs, committed, ok) as lists."""
    return (raw[:, :8 * B].copy().view(np.int64).tolist(), raw[:, 8 * B:12 * B].copy().view(np.float32).tolist(),
            raw[:, 12 * B:13 * B].astype(bool).tolist(), raw[:, 13 * B].astype(bool).tolist())


def slots_of(seqs: abc.Sequence[Sequence]) -> list[int]:
    """The slots of running sequences (the rows of the block manager's page tables)."""
    out = [s.slot for s in seqs if s.slot is not None]
    assert len(out) == len(seqs), "a running sequence holds a slot"
    return out


def _param_row(s: Sequence) -> tuple[float, ...]:
    """k, strategy, threshold, temperature, top_k, top_p, greedy of a sequence's next forward (_PAD's order)."""
    p = s.params
    k = s.schedule[min(s.step_in_block, len(s.schedule) - 1)]
    greedy = p.is_greedy
    return (k, _CODES[p.strategy], float(p.threshold), 1.0 if greedy else float(p.temperature),
            p.top_k, float(p.top_p), greedy)
