"""The batched engine equals its row-by-row definition: sampler, commit rules, noise, per-row failures."""

import dataclasses
import random

import pytest
import torch

from dllm.commit import commit_mask, commit_positions
from dllm.decoding import generate
from dllm.model import SDARForCausalLM
from dllm.sampling import (
    SamplingParams,
    counter_uniforms,
    sample_batch,
    sample_tokens,
    sampling_logprobs,
)
from dllm.strategy import Strategy
from tests.helpers import OverflowingParams, tiny_config

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23]]
MIXED = [  # every knob differs between rows of one batch
    dict(temperature=1.0, seed=1), dict(temperature=0.0), dict(temperature=1e-38, seed=3),
    dict(temperature=0.7, top_k=5, seed=4), dict(temperature=1.3, top_p=0.8, seed=5),
    dict(temperature=0.5, top_k=20, top_p=0.6, seed=6), dict(temperature=2.0, top_k=200, seed=7),
    dict(temperature=1.0, top_p=0.01, seed=8), dict(temperature=0.0, top_k=3, top_p=0.5),
    dict(temperature=1.0, seed=2**63 - 1),
]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


def uniforms_for(seeds, N, B):
    pos = torch.arange(N * B).view(N, B) + 17
    return torch.from_numpy(counter_uniforms(seeds, pos.numpy(), (torch.arange(N) % 4 + 1).numpy()))


def test_sample_batch_equals_row_by_row_definition():
    torch.manual_seed(0)
    N, B, V, mask = len(MIXED), 4, 64, 63
    params = [SamplingParams(**kw) for kw in MIXED]
    for trial in range(3):
        logits = torch.randn(N, B, V) * (1 + 2 * trial)
        u = uniforms_for([p.seed or 0 for p in params], N, B)
        ids, lp = sample_batch(logits, params, u, mask)
        assert ids.shape == lp.shape == (N, B) and not (ids == mask).any()
        for r, p in enumerate(params):
            ref_ids, ref_lp = sample_tokens(sampling_logprobs(logits[r], p, mask), p, u[r])
            assert torch.equal(ids[r], ref_ids), (r, p)
            assert torch.equal(lp[r], ref_lp), (r, p)
        assert torch.equal(ids[2], logits[2].index_fill(-1, torch.tensor([mask]), -1e9).argmax(-1))  # floor: greedy


def test_counter_noise_samples_the_distribution():
    """Inverse-CDF draws from the hashed uniforms follow the distribution (40k draws, 6 tokens)."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    n = 40_000
    seeds, pos = list(range(n // 8)), [[100 + i for i in range(8)]] * (n // 8)
    u = torch.from_numpy(counter_uniforms(seeds, pos, [3] * (n // 8))).flatten()
    assert float(u.min()) > 0.0 and float(u.max()) <= 1.0
    ids, _ = sample_tokens(probs.log().expand(n, 6), SamplingParams(temperature=1.0), u)
    freq = torch.bincount(ids, minlength=6).float() / n
    assert (freq - probs).abs().max() < 0.012, freq
    other = torch.from_numpy(counter_uniforms(seeds, pos, [4] * (n // 8))).flatten()
    assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.03  # steps draw independently
    again = torch.from_numpy(counter_uniforms(seeds[::-1], pos, [3] * (n // 8))).flatten()
    assert torch.equal(again.view(-1, 8).flip(0).flatten(), u)  # a pure function of (seed, position, step)


def test_commit_mask_equals_row_rule_for_mixed_strategies():
    rng = random.Random(0)
    N, B = 200, 8
    conf = torch.rand(N, B)
    conf[::7, :3] = 0.5  # ties and values exactly at the threshold
    masked = torch.rand(N, B) < 0.7
    masked[:, 0] |= ~masked.any(-1)
    k = torch.tensor([rng.randint(1, B) for _ in range(N)])
    thr = torch.tensor([rng.choice([0.0, 0.5, 0.9, 1.0]) for _ in range(N)])
    names = [rng.choice(list(Strategy)) for _ in range(N)]
    got = commit_mask(conf, masked, k, thr, torch.tensor([s.code for s in names]))
    for r in range(N):
        pos = [i for i in range(B) if masked[r, i]]
        want = commit_positions(conf[r].tolist(), pos, int(k[r]), float(thr[r]), names[r])
        assert sorted(want) == [i for i in range(B) if got[r, i]], (r, names[r])


def test_dynamic_rule_edges():
    """Strictly above the threshold, and at least what the steps schedule asks for (SDAR / TraDo)."""
    conf = torch.tensor([[0.9, 0.95, 0.2, 0.1], [0.9, 0.9, 0.9, 0.1], [0.91, 0.92, 0.93, 0.1]])
    masked = torch.ones(3, 4, dtype=torch.bool)
    dyn = torch.full((3,), Strategy.dynamic.code)
    got = commit_mask(conf, masked, torch.tensor([1, 1, 2]), torch.full((3,), 0.9), dyn)
    assert got.tolist() == [[False, True, False, False],   # 0.9 is not above 0.9: only 0.95
                            [True, False, False, False],   # none above: the schedule's 1 (most confident)
                            [True, True, True, False]]     # 3 above >= the schedule's 2: all three
    got = commit_mask(conf, masked, torch.tensor([2, 2, 2]), torch.full((3,), 0.9), dyn)
    assert got.sum(-1).tolist() == [2, 2, 3]  # row 0: one above, the schedule asks for 2


def test_dynamic_with_steps_commits_the_schedule_minimum(model):
    outs = generate(model, PROMPTS, SamplingParams(max_tokens=16, strategy="dynamic", steps=2, threshold=1.0,
                                                   seed=0, ignore_eos=True))
    for o in outs:  # nothing is ever above a threshold of 1: exactly the schedule, 2 then 2
        steps = o.trace.steps + o.trace.tail_steps
        full = [steps[j:j + 4] for j in range(-o.trace.prompt_len % 4, len(steps), 4) if len(steps[j:j + 4]) == 4]
        assert full and all(sorted(b) == [1, 1, 2, 2] for b in full)


def test_mixed_batch_equals_each_sequence_alone(model):
    """One batch with every parameter mixed == each sequence decoded on its own (same seeds)."""
    strategies = [dict(strategy="static", steps=2), dict(strategy="dynamic", threshold=0.05),
                  dict(strategy="sequential"), dict(strategy="dynamic", threshold=0.3, steps=2)]
    params = [SamplingParams(max_tokens=7, **MIXED[i], **strategies[i % 4]) for i in range(len(MIXED))]
    prompts = [PROMPTS[i % 4] for i in range(len(MIXED))]
    together = generate(model, prompts, params, eos_ids=[5])
    for prompt, p, out in zip(prompts, params, together):
        alone = generate(model, [prompt], p, eos_ids=[5])[0]
        assert (out.completion_ids, out.trace.steps, out.finish_reason) == \
               (alone.completion_ids, alone.trace.steps, alone.finish_reason)
        assert max(abs(a - b) for a, b in zip(out.trace.logprobs, alone.trace.logprobs)) < 1e-5


def test_non_finite_row_fails_alone(model):
    good = SamplingParams(max_tokens=8, seed=1)
    bad = OverflowingParams(**{**dataclasses.asdict(good), "temperature": 1e-45})
    outs = generate(model, PROMPTS, [good, bad, good, good])
    alone = generate(model, [PROMPTS[0], PROMPTS[2], PROMPTS[3]], good)
    assert outs[1].finish_reason == "error" and "not finite" in outs[1].error
    assert outs[1].completion_ids == [] and outs[1].num_forwards == 1
    assert [o.completion_ids for o in (outs[0], outs[2], outs[3])] == [o.completion_ids for o in alone]


def test_sampling_is_device_generic():
    """Sampler and commit rule create every tensor on the logits' device (here "meta", where any CPU
    tensor or CPU generator mixed in would raise); the noise is host data shipped with the inputs."""
    dev = torch.device("meta")
    N, B, V = 3, 4, 10
    params = [SamplingParams(seed=1, top_k=3), SamplingParams(temperature=0), SamplingParams(top_p=0.5, seed=2)]
    u = torch.from_numpy(counter_uniforms([1, 0, 2], [[0] * B] * N, [1] * N)).to(dev)
    ids, lp = sample_batch(torch.empty(N, B, V, device=dev), params, u, V - 1)
    masked = torch.ones(N, B, dtype=torch.bool, device=dev)
    commit = commit_mask(lp.exp(), masked, torch.ones(N, dtype=torch.long, device=dev),
                         torch.full((N,), 0.9, device=dev), torch.zeros(N, dtype=torch.long, device=dev))
    assert u.device == ids.device == lp.device == commit.device == dev


def test_seeded_decoding_uses_no_generator(model, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decoding created a torch.Generator")

    monkeypatch.setattr(torch, "Generator", refuse)
    a = generate(model, PROMPTS, SamplingParams(max_tokens=6, seed=11))
    b = generate(model, PROMPTS[::-1], SamplingParams(max_tokens=6, seed=11))
    assert [o.completion_ids for o in a] == [o.completion_ids for o in b[::-1]]
