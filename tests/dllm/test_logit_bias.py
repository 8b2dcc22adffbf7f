"""logit_bias in dllm (issue 47): the checks, the sampler (batched = the definition), a ban and a force in
block decoding (SDAR) and full-attention decoding (LLaDA), and the replay invariant for biased traces (the
trace records the bias; replay adds it; the trainer's chunked log-probs too).

    .venv/bin/python -m pytest -q tests/dllm/test_logit_bias.py
"""

from __future__ import annotations

import pytest
import torch

from dllm.errors import FieldError
from dllm.full.decoding import generate_full
from dllm.full.model import FullAttentionLM
from dllm.full.replay import build_full_rows, full_replay_hidden
from dllm.logit_bias import MAX_ENTRIES, check_logit_bias
from dllm.model import SDARForCausalLM
from dllm.replay import build_rows, dense_row_bias, replay_hidden, token_logprobs
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams, sample_batch, sampling_logprobs
from tests.helpers import drive, load_full_models, tiny_config
from trainer.rl.replay import chunked_token_logprobs


@pytest.fixture(scope="module")
def model() -> SDARForCausalLM:
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


@pytest.mark.parametrize("bias,says", [
    ({"x": 1}, "keys must be token ids"), ({"1.5": 1}, "keys must be token ids"), ({"-3": 1}, ">= 0"),
    ({True: 1}, "keys must be token ids"), ({"64": 1}, "outside the vocabulary"), ({"63": 1}, "mask token"),
    ({"5": 101}, "[-100, 100]"), ({"5": float("nan")}, "finite"), ({"5": float("inf")}, "finite"),
    ({"5": "1"}, "finite number"), ({"5": True}, "finite number"), ({"5": 1, 5: 2}, "given twice"),
    ({str(i): 1 for i in range(MAX_ENTRIES + 1)}, f"at most {MAX_ENTRIES}"), ([1, 2], "must be an object"),
])
def test_hostile_biases_are_refused_by_name(bias: object, says: str) -> None:
    with pytest.raises(FieldError) as e:
        check_logit_bias(bias, vocab_size=64, mask_id=63)
    assert e.value.field == "logit_bias" and says in e.value.message, e.value.message


def test_the_bias_is_normalised() -> None:
    assert check_logit_bias({"5": -100, 7: 2.5, "0": 100}, 64, 63) == {5: -100.0, 7: 2.5, 0: 100.0}
    assert check_logit_bias({}) is None and check_logit_bias(None) is None


def test_batched_sampler_is_the_definition_with_a_bias() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 64)
    params = [SamplingParams(temperature=0.7, logit_bias={3: 5.0, 9: -100.0}), SamplingParams(),
              SamplingParams(temperature=0.0, top_k=5, logit_bias={11: 100.0})]
    u = torch.rand(3, 4, dtype=torch.float64).clamp_(min=1e-9)
    ids, lp = sample_batch(logits.clone(), params, u, mask_token_id=63)
    for r, p in enumerate(params):
        ref = sampling_logprobs(logits[r], p, 63)
        assert torch.allclose(lp[r], ref.gather(-1, ids[r, :, None]).squeeze(-1), atol=0, rtol=0)
    assert (ids[2] == 11).all() and not (ids[0] == 9).any()


def _decode(model: SDARForCausalLM, bias: dict[int, float] | None, temperature: float = 0.0, **kw: object) -> list:
    runner = BlockRunner(model, max_batch=4, max_len=32, eos_ids=[0], num_pages=16, **kw)
    reqs = [([5, 6, 7], SamplingParams(max_tokens=8, temperature=temperature, seed=s, strategy="static", steps=2,
                                       ignore_eos=True, logit_bias=bias)) for s in range(3)]
    return drive(runner, reqs, 3)


@pytest.mark.parametrize("compile", [False, "eager"])
def test_ban_and_force_in_block_decoding(model: SDARForCausalLM, compile: object) -> None:
    free = _decode(model, None, compile=compile)
    top = free[0].completion_ids[0]
    banned = _decode(model, {top: -100.0}, compile=compile)
    assert all(top not in s.completion_ids for s in banned)
    forced = _decode(model, {42: 100.0}, temperature=1.0, compile=compile)
    assert all(s.completion_ids == [42] * 8 for s in forced)
    assert forced[0].trace.logit_bias == {42: 100.0}


def test_replay_reproduces_a_biased_trace(model: SDARForCausalLM) -> None:
    bias = {3: 4.0, 17: -2.5, 42: 1.5}
    seqs = _decode(model, bias, temperature=1.0)
    rows = build_rows(seqs, 4, 63, pad_id=0)
    assert rows.bias is not None
    with torch.no_grad():
        logits = model.lm_head(replay_hidden(model, rows))
        lp = token_logprobs(logits, rows.clean, 63, bias=dense_row_bias(rows.bias, 64))
        unbiased = token_logprobs(logits, rows.clean, 63)
        target = rows.target
        chunked, _, _ = chunked_token_logprobs(model.lm_head, replay_hidden(model, rows)[target], rows.clean[target],
                                               63, chunk=5, bias=rows.token_bias(target))
    old = rows.gather([s.trace.logprobs for s in seqs])
    assert (lp - old)[target].abs().max() < 1e-4  # the replay invariant, biased
    assert (chunked - old[target]).abs().max() < 1e-4  # the trainer's chunked scoring
    assert (unbiased - old)[target].abs().max() > 1e-2  # the bias matters: replay without it is off


@pytest.fixture(scope="module")
def full_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FullAttentionLM]:
    return load_full_models(tmp_path_factory.mktemp("bias-full"))


@pytest.mark.parametrize("family,rng,compile", [("llada", "counter", False), ("llada", "official", False),
                                                ("llada", "counter", "eager"), ("dream", "counter", False)])
def test_full_attention_ban_force_and_replay(full_models: dict[str, FullAttentionLM], family: str, rng: str,
                                             compile: object) -> None:
    """LLaDA / Dream (exact mode): eager, compiled static step, and the official draws all apply the bias;
    the biased trace replays to < 1e-4."""
    model = full_models[family]
    V, mask = model.config.vocab_size, model.config.mask_token_id
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]

    def run(bias: dict[int, float] | None, temperature: float = 1.0) -> list:
        p = SamplingParams(max_tokens=8, temperature=temperature, strategy="static", steps=2, seed=5,
                           logit_bias=bias)
        return generate_full(model, prompts, p, cache_mode="exact", eos_ids=[], rng=rng, compile=compile)

    free = run(None, 0.0)
    top = free[0].completion_ids[0]
    assert all(top not in o.completion_ids for o in run({top: -100.0}, 0.0))
    assert all(o.completion_ids == [21] * 8 for o in run({21: 100.0}))
    bias = {3: 3.0, 21: 2.0, 30: -4.0}
    outs = run(bias)
    assert outs[0].trace.logit_bias == bias
    rows = build_full_rows(outs, mask, 0)
    with torch.no_grad():
        logits = model.lm_head(full_replay_hidden(model, rows))
        lp = token_logprobs(logits, rows.clean, mask, bias=dense_row_bias(rows.bias, V))
        unbiased = token_logprobs(logits, rows.clean, mask)
    old = rows.gather([o.trace.logprobs for o in outs])
    assert (lp - old)[rows.target].abs().max() < 1e-4
    assert (unbiased - old)[rows.target].abs().max() > 1e-2
