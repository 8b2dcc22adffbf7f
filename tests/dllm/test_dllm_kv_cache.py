"""Block-paged KV cache: scattered pages equal the dense forward; memory follows sequence lengths."""

import pytest
import torch

from dllm.decoding import BlockDecoder, CacheFull, generate
from dllm.kv_cache import KVCache
from dllm.model import SDARForCausalLM
from dllm.sampling import SamplingParams
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


def test_scattered_pages_equal_dense_forward(model):
    ids = torch.randint(0, 63, (2, 16))
    cache = KVCache(model.config, num_slots=3, max_len=32, device="cpu", dtype=torch.float32, num_pages=12)
    slots = torch.tensor([2, 0])
    with torch.no_grad():
        dense = model(ids)
        got = []
        for b in range(0, 16, 4):  # pages handed out interleaved (and one taken by slot 1 in between)
            cache.allocate(2, b + 4)
            cache.allocate(1, b // 2 + 1)
            cache.allocate(0, b + 4)
            got.append(model(ids[:, b:b + 4], torch.arange(b, b + 4).expand(2, 4), cache=cache, slots=slots,
                             kv_len=b + 4))
    assert cache.slot_pages[2] == [1, 4, 6, 9] and cache.slot_pages[0] == [3, 5, 8, 10]  # not contiguous
    assert (torch.cat(got, dim=1) - dense).abs().max().item() < 1e-5
    used = {p for pages in cache.slot_pages for p in pages}
    assert len(used) == 4 + 4 + 2 and cache.num_free_pages == 12 - 10 and 0 not in used
    cache.free(2)
    assert cache.num_free_pages == 6 and cache.slot_pages[2] == [] and int(cache.page_table[2].max()) == 0
    with pytest.raises(CacheFull):
        cache.allocate(2, 7 * 4)


def test_sequences_hold_only_their_own_pages(model):
    dec = BlockDecoder(model, max_batch=4, max_len=64, eos_ids=[], num_pages=10)
    short = dec.new_sequence([1, 2, 3], SamplingParams(max_tokens=5))      # 8 tokens: 2 pages
    long = dec.new_sequence([1] * 9, SamplingParams(max_tokens=23))        # 32 tokens: 8 pages
    extra = dec.new_sequence([4, 5], SamplingParams(max_tokens=2))         # 1 page
    assert [dec.num_pages_needed(s) for s in (short, long, extra)] == [2, 8, 1]
    assert dec.num_admissible([short, long, extra]) == 2  # 2 + 8 pages fill the pool; 4 slots are not the limit
    dec.add([short, long])
    assert dec.cache.num_free_pages == 0 and dec.num_admissible([extra]) == 0
    with pytest.raises(CacheFull):
        dec.add(extra)
    running = [short, long]
    while not short.is_finished:
        dec.step(running)
        running = [s for s in running if not s.is_finished]
    assert dec.cache.num_free_pages == 2 and dec.num_admissible([extra]) == 1  # short's pages came back
    dec.add(extra)


def test_small_pool_decodes_in_waves_with_the_same_results(model):
    """A pool with room for two sequences at a time gives exactly the outputs of an ample one."""
    prompts = [[1 + i, 2, 3, 4, 5 + i] for i in range(6)]
    params = SamplingParams(max_tokens=11, seed=4, strategy="static", steps=2)
    want = generate(model, prompts, params)
    dec = BlockDecoder(model, max_batch=6, max_len=32, eos_ids=model.config.eos_ids, num_pages=8)
    waiting = [dec.new_sequence(p, params) for p in prompts]
    seqs, running, widest = list(waiting), [], 0
    while waiting or running:
        n = dec.num_admissible(waiting)
        dec.add(waiting[:n])
        running, waiting = running + waiting[:n], waiting[n:]
        widest = max(widest, len(running))
        dec.step(running)
        running = [s for s in running if not s.is_finished]
    assert widest == 2 and dec.cache.num_free_pages == 8
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
