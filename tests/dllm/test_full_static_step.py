"""The static-shape full-attention step (dllm/full/step.py) compiled per bucket: after `warmup()` a run of varying
batch sizes, prompt lengths and positions compiles nothing more and gives the eager decoder's tokens, steps and
log-probabilities, in both cache modes (the prefix cache with a further_horizon window). Traced with dynamo's
"eager" backend (the CPU proof of shapes and recompiles); inductor vs eager: benchmarks/full_attention.py."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from dllm.embedded.full_folders import tiny_full_config
from dllm.errors import FieldError
from dllm.full.model import FullAttentionLM
from dllm.full.runner import FullRunner
from dllm.sampling import SamplingParams
from tests.helpers import assert_same_decoding, drive, watch_recompiles


def model_of(family: str) -> FullAttentionLM:
    torch.manual_seed(0)
    cfg = tiny_full_config(family, block_size=4, max_position_embeddings=64)
    m = FullAttentionLM(cfg).eval()
    m.init_weights(0.3)
    return m


def requests(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    """Unfiltered requests of 1..3 prompt tokens and 1..8 new ones (canvases of 5..11 positions)."""
    rng = random.Random(seed)
    return [([rng.randrange(1, 80) for _ in range(rng.randint(1, 3))],
             SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8, 1.0]),
                            strategy=rng.choice(["static", "dynamic", "sequential"]), steps=rng.choice([None, 2]),
                            threshold=0.3, seed=rng.randrange(1 << 30), ignore_eos=rng.random() < 0.5))
            for _ in range(n)]


@pytest.mark.parametrize(("family", "mode", "max_batch", "horizon"), [("llada", "exact", 2, None),
                                                                      ("dream", "prefix", 1, 0)])
def test_static_buckets_compile_once_then_never(family: str, mode: str, max_batch: int, horizon: int | None) -> None:
    model = model_of(family)
    eos = [model.config.eos_ids[0]]
    torch._dynamo.reset()
    counters.clear()
    opts: dict[str, Any] = dict(max_batch=max_batch, max_len=12, eos_ids=eos, cache_mode=mode, further_horizon=horizon)
    static = FullRunner(model, compile="eager", **opts)
    assert static.static is not None
    keys = static.static.warmup(filtered=(False,))
    assert keys == counters["stats"]["unique_graphs"] == len(static.static.keys((False,)))
    with watch_recompiles(reset=True) as events:
        for seed in (1,):
            got = drive(static, requests(seed, 5), max_batch)
            assert_same_decoding(got, drive(FullRunner(model, **opts), requests(seed, 5), max_batch))
        assert events.messages == [] and counters["stats"]["unique_graphs"] == keys


def test_buckets_and_refusals() -> None:
    model = model_of("llada")
    dec = FullRunner(model, max_batch=5, max_len=30, cache_mode="prefix", further_horizon=6, compile=False,
                      cuda_graphs=False)
    assert dec.static is None  # eager unless compiled or captured
    from dllm.full.step import FullStep

    step = FullStep(model, max_batch=5, max_len=30, cache_mode="prefix", further_horizon=6)
    assert step.row_buckets == [1, 2, 4, 5] and step.len_buckets == [4, 8, 16, 32, 36]
    assert step.win_buckets == [4, 8, 12] and step.cache is not None and step.cache[0].shape[0] == 6  # + scratch
    with pytest.raises(FieldError, match="rng"):
        FullRunner(model, max_batch=1, rng="official", compile="eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture of the full-attention step)")
@pytest.mark.parametrize("mode", ["exact", "prefix"])
def test_cuda_graphs_equal_eager(mode: str) -> None:
    model = model_of("dream").to("cuda")
    opts: dict[str, Any] = dict(max_batch=2, max_len=12, eos_ids=[model.config.eos_ids[0]], cache_mode=mode, further_horizon=4)
    graphed = drive(FullRunner(model, cuda_graphs=True, **opts), requests(3, 4), 2)
    eager = drive(FullRunner(model, **opts), requests(3, 4), 2)
    for x, y in zip(graphed, eager, strict=True):
        assert x.completion_ids == y.completion_ids and x.trace.steps == y.trace.steps
