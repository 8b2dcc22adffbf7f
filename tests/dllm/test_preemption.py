"""Optimistic KV admission with preemption by recompute (dllm.decoding.BlockDecoder(optimistic=True)): a
sequence preempted mid-block, mid-prompt or right after a block keeps its committed tokens and steps, and
when added again goes on to exactly the tokens, steps and logprobs of a run that was never preempted."""

import random

import torch

from dllm.decoding import BlockDecoder
from dllm.model import SDARForCausalLM
from dllm.sampling import SamplingParams
from dllm.sequence import Sequence
from tests.helpers import tiny_config


def test_preempted_sequences_keep_an_exact_trace():
    torch.manual_seed(0)
    model = SDARForCausalLM(tiny_config(eos_token_id=0)).eval()
    rng = random.Random(3)
    reqs = [([rng.randrange(1, 63) for _ in range(rng.randint(1, 9))],
             SamplingParams(max_tokens=rng.randint(3, 14), temperature=rng.choice([0.0, 1.0]), seed=i,
                            strategy=rng.choice(["static", "dynamic"]), steps=rng.choice([None, 2]), threshold=0.3,
                            ignore_eos=True)) for i in range(6)]
    ref = BlockDecoder(model, max_batch=6, max_len=32, eos_ids=[0], num_pages=64)
    want = [ref.new_sequence(p, q) for p, q in reqs]
    ref.add(want)
    running = list(want)
    while running:
        ref.step(running)
        running = [s for s in running if not s.is_finished]

    dec = BlockDecoder(model, max_batch=6, max_len=32, eos_ids=[0], num_pages=64, optimistic=True)
    got = [dec.new_sequence(p, q) for p, q in reqs]
    assert dec.num_pages_needed(got[0]) < ref.num_pages_needed(want[0])  # the next block's pages only
    dec.add(got)
    running, out, step = list(got), [], 0
    while running or out:
        step += 1
        if step % 2 == 0 and running:  # preempt one, re-add the ones preempted before
            victim = running[step % len(running)]
            dec.preempt(victim)
            running.remove(victim)
            back, out = out, [victim]
            dec.add(back)
            running += back
        elif out:
            dec.add(out)
            running, out = running + out, []
        if running:
            assert dec.num_pages_short(running) == 0
            dec.step(running)
            running = [s for s in running if not s.is_finished]
    assert dec.num_preempted >= 5 and dec.num_fill_forwards > 0
    for a, b in zip(got, want, strict=True):
        assert a.completion_ids == b.completion_ids and a.trace.steps == b.trace.steps
        assert torch.allclose(torch.tensor(a.trace.logprobs), torch.tensor(b.trace.logprobs), atol=1e-5, rtol=0)
    assert dec.cache is not None and dec.cache.num_free_pages == dec.cache.num_pages  # all given back
    assert isinstance(got[0], Sequence)
