"""Where a step's typed inputs live: one device buffer, filled through a host buffer with ONE copy per step.

    bufs = StepBuffers(block_size=4, device=dev, max_rows=32, max_sampled=16, max_pages=64)
    host, x = bufs.get(R=8, Rn=4, P=16)     # host: {field: numpy view}, x: dllm.step.StepInputs (device views)
    host["ids"][:n] = ...; ...              # the runner writes every field of the bucket
    bufs.upload(8, 4, 16)                   # host -> device, one copy of the bucket's bytes (none on CPU)

Each bucket (rows R, sampled rows Rn, pages of keys P) lays its fields out back to back (8-byte
types first, booleans last: every field aligned) from byte 0 of the buffer; its views are made
once and reused, so the compiled step and a captured CUDA graph always read the same storage.
On CUDA the host buffer is pinned and the copy is asynchronous (the step's one device-to-host
copy of its results, after the forward, orders it); on CPU the host views are the device buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from dllm.step import StepInputs

# (field, dtype, rows: "R" | "Rn", columns: "B" | "P" | None), in layout order
LAYOUT = (("ids", torch.int64, "R", "B"), ("block_start", torch.int64, "R", None),
          ("page_table", torch.int64, "R", "P"), ("k", torch.int64, "Rn", None), ("strategy", torch.int64, "Rn", None),
          ("top_k", torch.int64, "Rn", None), ("threshold", torch.float64, "Rn", None),
          ("temperature", torch.float64, "Rn", None), ("top_p", torch.float64, "Rn", None),
          ("uniforms", torch.float64, "Rn", "B"), ("write", torch.bool, "R", None), ("greedy", torch.bool, "Rn", None))
_NUMPY = {torch.int64: np.int64, torch.float64: np.float64, torch.bool: np.bool_}
assert {f for f, *_ in LAYOUT} == set(StepInputs._fields), "LAYOUT: every field of StepInputs, once"


def _shapes(R: int, Rn: int, P: int, B: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    dims = {"R": R, "Rn": Rn, "B": B, "P": P}
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
