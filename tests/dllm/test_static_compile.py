"""The decode step compiled per bucket with static shapes (dllm.runner, `static_shapes=True`): after
`warmup()` a run of varying batch sizes, prompt lengths and positions compiles nothing more and gives the
eager step's tokens, steps and logprobs; the flash-attn decode path equals SDPA (CUDA only). An
inductor-compiled bucket against eager (equality, kernels, time per step): benchmarks/static_step.py."""

import random

import pytest
import torch
from torch._dynamo.utils import counters

from dllm.attention import flash_attn_importable, flash_decode, sdpa_decode
from dllm.model import SDARForCausalLM
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams
from tests.helpers import assert_same_decoding, drive, tiny_config, watch_recompiles


@pytest.fixture(scope="module")
def model() -> SDARForCausalLM:
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


def requests(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    """Unfiltered requests (no top-k / top-p) of 1..3 prompt tokens and 1..4 new ones (<= 8 positions), some
    with a logit_bias (a step input of static width: it never adds a compile)."""
    rng = random.Random(seed)
    return [([rng.randrange(1, 63) for _ in range(rng.randint(1, 3))],
             SamplingParams(max_tokens=rng.randint(1, 4), temperature=rng.choice([0.0, 0.8, 1.0]),
                            strategy=rng.choice(["static", "dynamic", "sequential"]), steps=rng.choice([None, 2]),
                            threshold=0.3, seed=rng.randrange(1 << 30), ignore_eos=rng.random() < 0.5,
                            logit_bias=rng.choice([None, {rng.randrange(1, 63): rng.uniform(-100, 100)
                                                          for _ in range(rng.randint(1, 5))}])))
            for _ in range(n)]


def test_static_buckets_compile_once_then_never(model: SDARForCausalLM):
    torch._dynamo.reset()
    counters.clear()
    static = BlockRunner(model, max_batch=1, max_len=8, eos_ids=[0], num_pages=4, compile="eager")
    assert static.static_shapes
    keys = static.warmup(filtered=(False,))
    assert keys == counters["stats"]["unique_graphs"] == 4  # rows 1 / 2 (the clean block owed), keys 4 / 8
    with watch_recompiles(reset=True) as events:  # reset: its per-bucket graphs would serve other tests' steps
        for seed in (1, 2):
            got = drive(static, requests(seed, 4), 1)
            ref = drive(BlockRunner(model, max_batch=1, max_len=8, eos_ids=[0], num_pages=4), requests(seed, 4), 1)
            assert_same_decoding(got, ref)
        assert events.messages == [] and counters["stats"]["unique_graphs"] == keys


def test_flash_decode_definition_is_the_step_mask():
    """`sdpa_decode` (what flash_decode computes: keys [0, block end), no causal mask) equals the decode
    step's block-causal mask over a bucket of keys (CPU, fp32)."""
    from dllm.attention import MaskSpec, attend

    g = torch.Generator().manual_seed(0)
    B, KV = 4, 16
    q = torch.randn(3, B, 4, 16, generator=g)
    k, v = (torch.randn(3, KV, 2, 16, generator=g) for _ in range(2))
    pos = torch.tensor([0, 4, 12])[:, None] + torch.arange(B)
    kp = torch.arange(KV).expand(3, KV)
    spec = MaskSpec(pos, kp, B, k_valid=kp <= pos[:, -1:], backend="sdpa")
    ref = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec).transpose(1, 2)
    got = sdpa_decode(q, k, v, (pos[:, -1] + 1).to(torch.int32))
    assert torch.allclose(got, ref, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flash_attn_importable()),
                    reason="needs CUDA and flash-attn (flash_attn_with_kvcache)")
def test_flash_decode_equals_sdpa_on_cuda(model: SDARForCausalLM):
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(5, 4, 8, 64, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(5, 40, 2, 64, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        seqlens = torch.tensor([4, 8, 17, 40, 1], device="cuda", dtype=torch.int32)
        ref = sdpa_decode(q.float(), k.float(), v.float(), seqlens)
        assert (flash_decode(q, k, v, seqlens).float() - ref).abs().max().item() < 2e-2
        assert (sdpa_decode(q, k, v, seqlens).float() - ref).abs().max().item() < 2e-2
    # the whole compiled decode step with each kernel, bf16: same greedy tokens nearly everywhere
    served = SDARForCausalLM(tiny_config(eos_token_id=0, head_dim=64)).to("cuda", torch.bfloat16).eval()
    reqs = [(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p, _ in requests(3, 6)]
    runs = {a: drive(BlockRunner(served, max_batch=4, max_len=16, eos_ids=[0], num_pages=32, compile=True,
                                 attention=a), reqs, 2) for a in ("flash", "sdpa")}
    same = sum(x == y for a, b in zip(runs["flash"], runs["sdpa"]) for x, y in zip(a.completion_ids, b.completion_ids))
    assert same >= 0.9 * sum(len(s.completion_ids) for s in runs["sdpa"])
