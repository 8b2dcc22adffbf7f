"""Prefix sharing (dllm.block_manager + dllm.runner): the samples of a prompt and prompts with a common prefix share
their complete prompt blocks, and decode exactly as without sharing (seeded: tokens, steps, logprobs) -- admitted
together or steps apart, and across a weight push that lands mid-rollout, where a sequence of the new version
never reads a page of the old one (the key holds the version: a key without it would, and the test shows it)."""

import random

import pytest
import torch

from dllm import block_manager
from dllm.decoding import Decoder, generate
from dllm.model import SDARForCausalLM
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams
from dllm.weights import copy_into_model
from tests.helpers import drive, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and x.trace.steps == y.trace.steps
        assert torch.allclose(torch.tensor(x.trace.logprobs), torch.tensor(y.trace.logprobs), atol=1e-5, rtol=0)


def requests(rng: random.Random, n: int = 4) -> list[tuple[list[int], SamplingParams]]:
    """n seeded samples of each prompt: one-block and multi-block prompts, and prompts that extend others
    (a sequence may share a page the same step's prefill of another writes)."""
    base = [rng.randrange(1, 63) for _ in range(13)]
    prompts = [base[:5], base[:4] + [7, 8, 9, 10, 11, 12, 13, 14, 15], base, base[:2], base[:9]]
    return [(p, SamplingParams(max_tokens=rng.randint(4, 10), temperature=rng.choice([0.0, 1.0]), seed=100 * i + j,
                               strategy=rng.choice(["static", "dynamic"]), steps=2, threshold=0.3, ignore_eos=True))
            for i, p in enumerate(prompts) for j in range(n)]


def test_samples_and_common_prefixes_share_pages_with_the_same_traces(model):
    reqs = requests(random.Random(1))
    prompts, params = [p for p, _ in reqs], [q for _, q in reqs]
    same(generate(model, prompts, params, prefix_sharing=True), generate(model, prompts, params, prefix_sharing=False))

    on, off = (BlockRunner(model, max_batch=len(reqs), max_len=32, eos_ids=[0], prefix_sharing=s) for s in (True, False))
    dec = {r: Decoder(r) for r in (on, off)}
    got = {r: drive(r, reqs, admit=len(reqs), decoder=dec[r]) for r in (on, off)}  # all admitted in one step
    same(got[on], got[off])
    prompt_tokens = sum(len(p) // 4 * 4 for p in prompts)
    # unique blocks: base[:4]; base[:4] + 9 more: 2 of its own; base: 2 more (base[:9] has none of its own)
    assert off.num_prefill_positions == prompt_tokens and on.num_prefill_positions == 4 + 8 + 8
    blocks = dec[on].scheduler.blocks
    assert blocks.num_queried_tokens == sum(len(p) for p in prompts)
    assert blocks.num_hit_tokens == prompt_tokens - on.num_prefill_positions
    assert dec[off].scheduler.blocks.num_hit_tokens == 0


def test_later_requests_find_the_cached_prefix(model):
    """A prompt's blocks outlive its sequences: later requests (here one at a time) compute only the rest."""
    reqs = requests(random.Random(2), n=2)
    on, off = (BlockRunner(model, max_batch=2, max_len=32, eos_ids=[0], num_pages=24, prefix_sharing=s)
               for s in (True, False))
    same(drive(on, reqs, admit=1), drive(off, reqs, admit=1))
    assert on.num_prefill_positions == 4 + 8 + 8 < off.num_prefill_positions  # each unique block once


@pytest.mark.parametrize("versioned", [True, False])
def test_a_weight_push_mid_rollout_never_serves_old_pages(model, monkeypatch, versioned):
    """Sequence `old` (version 0) still runs -- holding its prompt's pages -- when new weights land (version 1);
    `new` has the same prompt: it must decode exactly as on a fresh runner with the new weights. With a key
    that ignored the version (`versioned=False`, patched in) it would read old's pages, and it does not."""
    torch.manual_seed(1)
    pushed = SDARForCausalLM(tiny_config(eos_token_id=0)).eval()
    served = SDARForCausalLM(tiny_config(eos_token_id=0)).eval()
    served.load_state_dict(model.state_dict())
    if not versioned:
        keys = block_manager.block_keys
        monkeypatch.setattr(block_manager, "block_keys", lambda ids, pages, version: keys(ids, pages, 0))
    prompt = list(range(1, 14))  # 3 complete blocks
    params = SamplingParams(max_tokens=12, seed=5, strategy="static", steps=2, ignore_eos=True)
    dec = Decoder(BlockRunner(served, max_batch=2, max_len=32, eos_ids=[0]))
    old = dec.runner.new_sequence(prompt, params)
    dec.add(old)
    for _ in range(3):
        dec.step()
    assert old.status == "running" and old.block_table
    copy_into_model(served, list(pushed.hf_named_tensors()))  # the push lands mid-rollout
    dec.version = 1
    new = dec.runner.new_sequence(prompt, params)
    dec.add(new)
    dec.run()
    want = generate(pushed, [prompt], params)[0]
    assert new.trace.version == 1 and old.trace.version == 0
    if versioned:
        same([new], [want])
        assert dec.runner.num_prefill_positions == 2 * 12 and dec.scheduler.blocks.num_hit_tokens == 0
    else:  # what the version in the key prevents: the old weights' K/V read by a new-version sequence
        assert dec.scheduler.blocks.num_hit_tokens == 12
        assert new.completion_ids != want.completion_ids or new.trace.logprobs != pytest.approx(want.trace.logprobs)


def test_a_shared_system_prompt_is_computed_once_and_prefilled_without_padding(model):
    """Requests with one system prompt and their own question: the first computes the system prompt, the
    others only their question, in a forward of their own (rows of similar length: no padding to 24)."""
    system = list(range(1, 21))  # 5 blocks
    reqs = [(system + [30 + i, 31, 32, 33, 34, 35], SamplingParams(max_tokens=8, seed=i, strategy="static",
                                                                   steps=2, ignore_eos=True)) for i in range(6)]
    on, off = (BlockRunner(model, max_batch=6, max_len=40, eos_ids=[0], prefix_sharing=s) for s in (True, False))
    same(drive(on, reqs, admit=6), drive(off, reqs, admit=6))
    assert (on.num_prefill_positions, off.num_prefill_positions) == (24 + 5 * 4, 6 * 24)
    assert (on.num_fill_forwards, off.num_fill_forwards) == (2, 1)  # [24], then [4] x 5; vs [24] x 6
