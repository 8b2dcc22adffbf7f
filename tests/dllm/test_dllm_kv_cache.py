"""Block-paged KV cache: scattered pages equal the dense forward; memory follows sequence lengths (the
scheduler's block manager admits what fits, dllm.block_manager)."""

import pytest
import torch

from dllm.decoding import CacheFull, Decoder, generate
from dllm.kv_cache import KVCache
from dllm.model import SDARForCausalLM
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


def test_scattered_pages_equal_dense_forward(model):
    ids = torch.randint(0, 63, (2, 16))
    cache = KVCache(model.config, num_pages=12, device="cpu", dtype=torch.float32)
    table = torch.tensor([[1, 4, 6, 9], [3, 5, 8, 10]])  # pages not contiguous, interleaved between the rows
    with torch.no_grad():
        dense = model(ids)
        got = [model(ids[:, b:b + 4], torch.arange(b, b + 4).expand(2, 4), cache=cache, page_table=table,
                     kv_len=b + 4) for b in range(0, 16, 4)]
    assert (torch.cat(got, dim=1) - dense).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="fixed_table"):
        cache.fixed_table(4, 16)  # 4 rows of 4 pages: more than the pool's 12


def test_sequences_hold_only_their_own_pages(model):
    runner = BlockRunner(model, max_batch=4, max_len=64, eos_ids=[], num_pages=10, prefix_sharing=False)
    dec = Decoder(runner)
    short = runner.new_sequence([1, 2, 3], SamplingParams(max_tokens=5))      # 8 tokens: 2 pages
    long = runner.new_sequence([1] * 9, SamplingParams(max_tokens=23))        # 32 tokens: 8 pages
    extra = runner.new_sequence([4, 5], SamplingParams(max_tokens=2))         # 1 page
    assert [runner.kv_budget.pages_for(s) for s in (short, long, extra)] == [2, 8, 1]
    blocks = dec.scheduler.blocks
    dec.add([short, long, extra])
    dec.step()  # 2 + 8 pages fill the pool; 4 slots are not the limit
    assert (short.status, long.status, extra.status) == ("running", "running", "waiting")
    assert blocks.num_free_pages == 0 and len(short.block_table) == 2 and len(long.block_table) == 8
    with pytest.raises(CacheFull):
        blocks.admit(extra, 0)
    while not short.is_finished:
        dec.step()
    assert blocks.num_free_pages == 2 and short.block_table == []  # short's pages came back ...
    dec.step()
    assert extra.status == "running" and len(extra.block_table) == 1  # ... and extra took one of them


def test_small_pool_decodes_in_waves_with_the_same_results(model):
    """A pool with room for two sequences at a time gives exactly the outputs of an ample one."""
    prompts = [[1 + i, 2, 3, 4, 5 + i] for i in range(6)]
    params = SamplingParams(max_tokens=11, seed=4, strategy="static", steps=2)
    want = generate(model, prompts, params)
    dec = Decoder(BlockRunner(model, max_batch=6, max_len=32, eos_ids=model.config.eos_ids, num_pages=8))
    seqs = [dec.runner.new_sequence(p, params) for p in prompts]
    dec.add(seqs)
    widest = 0
    while not dec.is_done:
        ended = dec.step()
        widest = max(widest, dec.scheduler.num_running + len(ended))  # the step's batch
    assert widest == 2 and dec.scheduler.free_pages == 8
    assert [s.completion_ids for s in seqs] == [o.completion_ids for o in want]
    assert [s.trace.steps for s in seqs] == [o.trace.steps for o in want]


def test_out_of_step_sequences_equal_the_no_cache_baseline(model):
    """Rows finish blocks at different forwards: a finished block's K/V rides along with the next
    denoising forward (or its own forward when few rows need it); results equal full recomputation."""
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23], [30]]
    params = [SamplingParams(max_tokens=14, seed=i, strategy=s, steps=st, threshold=0.05)
              for i, (s, st) in enumerate([("dynamic", None), ("static", 1), ("sequential", 4), ("static", 2),
                                           ("dynamic", 2)])]
    cached = generate(model, prompts, params)
    baseline = generate(model, prompts, params, use_cache=False)
    assert [o.completion_ids for o in cached] == [o.completion_ids for o in baseline]
    assert [o.trace.steps for o in cached] == [o.trace.steps for o in baseline]
    for a, b in zip(cached, baseline):
        assert max(abs(x - y) for x, y in zip(a.trace.logprobs, b.trace.logprobs)) < 1e-4
