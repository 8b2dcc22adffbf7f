"""Block decoding rules, stop conditions, seeds and exact traces."""

import pytest
import torch

from dllm.decoding import generate, transfer_schedule
from dllm.errors import TooLong
from dllm.model import SDARForCausalLM
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams, sampling_logprobs
from dllm.tokenizer import build_char_tokenizer
from tests.helpers import tiny_config

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


def blocks(out, B=4):
    """block index -> list of (position in completion, step), the last block's tail included."""
    res = {}
    for j, s in enumerate(out.trace.steps + out.trace.tail_steps):
        res.setdefault((out.trace.prompt_len + j) // B, []).append((j, s))
    return res


def test_transfer_schedule():
    assert transfer_schedule(4, 2) == [2, 2]
    assert transfer_schedule(3, 2) == [2, 1]
    assert transfer_schedule(2, 4) == [1, 1]
    assert sum(transfer_schedule(7, 3)) == 7


def test_static_commits_block_size_over_steps_per_forward(model):
    outs = generate(model, PROMPTS, SamplingParams(max_tokens=16, strategy="static", steps=2, seed=0,
                                                   ignore_eos=True))
    for o in outs:
        assert len(o.completion_ids) == 16 and o.finish_reason == "length"
        for toks in blocks(o).values():
            steps = [s for _, s in toks]
            counts = [steps.count(k) for k in range(1, max(steps) + 1)]
            assert counts == transfer_schedule(len(toks), 2)
            if len(toks) == 4:
                assert counts == [2, 2]


def test_dynamic_threshold_and_at_least_one(model):
    thr = 0.08
    outs = generate(model, PROMPTS, SamplingParams(max_tokens=16, strategy="dynamic", threshold=thr, seed=1,
                                                   ignore_eos=True))
    for o in outs:
        for toks in blocks(o).values():
            steps = sorted({s for _, s in toks})
            assert steps == list(range(1, len(steps) + 1))  # no empty forward
            for k in steps:
                if any(j >= len(o.trace.logprobs) for j, s in toks if s == k):
                    continue  # tail tokens carry no logprob
                confs = [o.trace.logprobs[j] for j, s in toks if s == k]
                probs = [float(torch.tensor(c).exp()) for c in confs]
                assert all(p >= thr for p in probs) or len(probs) == 1


def test_sequential_is_left_to_right(model):
    outs = generate(model, PROMPTS, SamplingParams(max_tokens=12, strategy="sequential", steps=4, seed=2,
                                                   ignore_eos=True))
    for o in outs:
        for toks in blocks(o).values():
            steps = [s for _, s in sorted(toks)]
            assert steps == sorted(steps) and steps == list(range(1, len(steps) + 1))


def test_seed_reproducible_and_batch_independent(model):
    p = SamplingParams(max_tokens=10, strategy="dynamic", threshold=0.1, seed=7)
    a = generate(model, PROMPTS, p)
    b = generate(model, PROMPTS, p)
    single = generate(model, [PROMPTS[1]], p)
    assert [o.completion_ids for o in a] == [o.completion_ids for o in b]
    assert a[1].completion_ids == single[0].completion_ids
    c = generate(model, PROMPTS, SamplingParams(max_tokens=10, strategy="dynamic", threshold=0.1, seed=8))
    assert [o.completion_ids for o in a] != [o.completion_ids for o in c]


def test_cache_and_no_cache_baseline_agree(model):
    p = SamplingParams(max_tokens=9, strategy="static", steps=2, seed=3)
    a = generate(model, PROMPTS, p, use_cache=True)
    b = generate(model, PROMPTS, p, use_cache=False)
    assert [o.completion_ids for o in a] == [o.completion_ids for o in b]
    assert [o.trace.steps for o in a] == [o.trace.steps for o in b]


def test_eos_stops_and_tail_is_kept(model):
    eos = 5  # a frequent token under this seed: make it the EOS
    outs = generate(model, PROMPTS * 4, SamplingParams(max_tokens=32, temperature=1.5, seed=4), eos_ids=[eos])
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "no sample hit the EOS id"
    for o in stopped:
        assert o.completion_ids[-1] == eos and eos not in o.completion_ids[:-1]
        assert len(o.trace.steps) == len(o.completion_ids) == len(o.trace.logprobs)
        end = o.trace.prompt_len + len(o.completion_ids) + len(o.trace.tail_ids)
        assert end % 4 == 0  # the tail completes the last block
    for o in outs:
        assert o.finish_reason in ("stop", "length")
        assert model.config.mask_token_id not in o.completion_ids + o.trace.tail_ids


def test_stop_strings_and_max_tokens(tmp_path):
    tok = build_char_tokenizer(tmp_path)
    torch.manual_seed(5)
    m = SDARForCausalLM(tiny_config(vocab_size=len(tok), mask_token_id=tok.mask_token_id,
                                    eos_token_id=tok.eos_token_id)).eval()
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("12+34=", "7+5=", "hello ")]
    free = generate(m, prompts, SamplingParams(max_tokens=24, seed=6, ignore_eos=True), tok)
    stop = free[0].text[5:7]
    outs = generate(m, prompts, SamplingParams(max_tokens=24, seed=6, ignore_eos=True, stop=[stop]), tok)
    o = outs[0]
    assert o.finish_reason == "stop" and stop not in o.text and free[0].text.startswith(o.text)
    assert stop in tok.decode(o.completion_ids) and stop not in tok.decode(o.completion_ids[:-1])
    short = generate(m, prompts, SamplingParams(max_tokens=3, seed=6, ignore_eos=True), tok)
    assert all(len(s.completion_ids) == 3 and s.finish_reason == "length" for s in short)


def test_trace_logprobs_equal_sampling_distribution(model):
    """Every token: step >= 1 and logprob == log softmax of the sampling distribution at that state."""
    params = SamplingParams(max_tokens=10, temperature=0.7, top_k=12, top_p=0.9, strategy="dynamic",
                            threshold=0.05, seed=9)
    outs = generate(model, PROMPTS, params)
    mask = model.config.mask_token_id
    for o in outs:
        full = o.prompt_ids + o.completion_ids + o.trace.tail_ids
        steps = o.trace.steps + o.trace.tail_steps
        P = o.trace.prompt_len
        for j, (s, lp) in enumerate(zip(o.trace.steps, o.trace.logprobs)):
            assert s >= 1
            b0 = (P + j) // 4 * 4
            state = list(full[:b0 + 4])
            for k in range(b0, b0 + 4):  # tokens of this block committed at step >= s are masked
                if k >= P and steps[k - P] >= s:
                    state[k] = mask
            with torch.no_grad():
                logits = model(torch.tensor([state]))[0, P + j]
            expect = sampling_logprobs(logits, params, mask)[full[P + j]]
            assert abs(float(expect) - lp) < 1e-4


def test_invalid_sampling_params_name_the_field(model):
    dec = BlockRunner(model, max_batch=1, max_len=68)  # room for the default max_tokens: one error per case
    for kwargs, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"strategy": "magic"}, "strategy"),
                          ({"steps": 9}, "steps"), ({"threshold": 2}, "threshold"), ({"seed": -1}, "seed"),
                          ({"max_tokens": 100}, "max_tokens")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            dec.new_sequence([1, 2], SamplingParams(**kwargs))
    with pytest.raises(ValueError, match="prompt_ids"):
        dec.new_sequence([1, 63], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        dec.new_sequence([], SamplingParams())
    with pytest.raises(TooLong, match="^prompt: prompt has 68 tokens; the limit is max_model_len=68"):
        dec.new_sequence([1] * 68, SamplingParams(temperature=-1))  # a prompt that cannot fit comes first
    with pytest.raises(TooLong, match=r"^max_tokens: prompt \(2 tokens\) \+ max_tokens \(67\) exceeds"):
        dec.new_sequence([1, 2], SamplingParams(max_tokens=67, steps=9))
