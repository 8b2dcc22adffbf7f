"""Optimistic KV admission with preemption by recompute (dllm.scheduler with KVBudget(optimistic=True)): a
sequence preempted mid-block, mid-prompt or right after a block keeps its committed tokens and steps, and
when re-admitted goes on to exactly the tokens, steps and logprobs of a run that was never preempted --
with its prompt pages shared with other sequences (prefix sharing) or not."""

import random

import pytest
import torch

from dllm.decoding import Decoder
from dllm.model import SDARForCausalLM
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams
from tests.helpers import tiny_config


@pytest.mark.parametrize("sharing", [False, True])
def test_preempted_sequences_keep_an_exact_trace(sharing):
    torch.manual_seed(0)
    model = SDARForCausalLM(tiny_config(eos_token_id=0)).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 63) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    prompts += [prompts[0], prompts[1] + [5, 6], prompts[0][:4]]  # prefixes shared when sharing is on
    reqs = [(p, SamplingParams(max_tokens=rng.randint(3, 14), temperature=rng.choice([0.0, 1.0]), seed=i,
                               strategy=rng.choice(["static", "dynamic"]), steps=rng.choice([None, 2]),
                               threshold=0.3, ignore_eos=True)) for i, p in enumerate(prompts)]
    ref = Decoder(BlockRunner(model, max_batch=6, max_len=32, eos_ids=[0], num_pages=64, prefix_sharing=False))
    want = [ref.runner.new_sequence(p, q) for p, q in reqs]
    ref.add(want)
    ref.run()

    # a pool of 9 pages for 6 sequences that grow to 2..6 pages each: the newest are preempted, again and again
    runner = BlockRunner(model, max_batch=6, max_len=32, eos_ids=[0], num_pages=9, optimistic=True,
                         prefix_sharing=sharing)
    dec = Decoder(runner)
    got = [runner.new_sequence(p, q) for p, q in reqs]
    assert runner.kv_budget.pages_for(got[0]) < ref.runner.kv_budget.pages_for(want[0])  # the next block only
    dec.add(got)
    dec.run()
    assert sum(s.num_preemptions for s in got) >= 3 and runner.num_fill_forwards > 0
    for a, b in zip(got, want, strict=True):
        assert a.completion_ids == b.completion_ids and a.trace.steps == b.trace.steps
        assert torch.allclose(torch.tensor(a.trace.logprobs), torch.tensor(b.trace.logprobs), atol=1e-5, rtol=0)
    blocks = dec.scheduler.blocks
    assert blocks.num_free_pages == 9 and blocks.num_free_slots == 6  # all given back
    assert (blocks.num_hit_tokens > 0) == sharing
