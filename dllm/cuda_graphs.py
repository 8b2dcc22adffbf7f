"""CUDA graphs over the static decode step: each bucket's step captured once, then replayed.

    graphs = GraphedSteps(decode_step, max_graphs=64)   # dllm.runner.BlockRunner makes it (cuda_graphs=True)
    out = graphs.run((R, Rn, KV, filtered), (model, cache, inputs, k_pos, filtered, attention))

The step reads only persistent storage -- the bucket's typed input buffers (dllm.step_inputs: the
caller copies the next inputs, page tables included, into them before `run`), the KV pools, the
parameters -- so a graph captured once stays valid: weight updates copy into the same parameter
storage (`dllm.weights.copy_into_model`). All graphs share
one memory pool (as nano-vllm's capture); the first `max_graphs` keys are captured lazily,
each logged, later keys run eagerly (logged once). `server.cuda_graphs` is off by default; it
ran on an H200 (torch 2.11: same tokens as eager, 3-4x faster steps at the SDAR-1.7B shape,
benchmarks/RESULTS.md); tests/dllm/test_dllm_step.py has the GPU-marked check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

log = logging.getLogger("dlrl.dllm")
T = TypeVar("T")  # what the step returns (tensors the graph's replays overwrite in place)


class GraphedSteps(Generic[T]):
    def __init__(self, fn: Callable[..., T], max_graphs: int = 64) -> None:
        self.fn, self.max_graphs = fn, max_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, T]] = {}
        self.pool: torch.cuda._POOL_HANDLE | None = None  # the memory pool all graphs share
        self._warned = False

    def run(self, key: tuple, args: tuple) -> T:
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.max_graphs:
                if not self._warned:
                    log.warning("cuda graphs: %d captured (the limit); key %s and later ones run eagerly",
                                len(self.graphs), key)
                    self._warned = True
                return self.fn(*args)
            entry = self.graphs[key] = self._capture(args)
            log.info("cuda graphs: captured %s (rows, sampled rows, keys, filtered); %d graphs", key, len(self.graphs))
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, T]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (lazy init, autotuning)
            self.fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(*args)
        self.pool = graph.pool()
        return graph, out
