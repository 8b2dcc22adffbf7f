"""Replay invariant (docs/DESIGN.md): replayed logprobs == the trace's behaviour logprobs."""

import pytest
import torch

from dllm.decoding import generate
from dllm.model import SDARForCausalLM
from dllm.replay import build_rows, token_logprobs, trace_hidden
from dllm.sampling import SamplingParams, sampling_logprobs
from tests.helpers import tiny_config
from trainer.rl.replay import completion_rows

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [30]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


def as_samples(outs):
    return outs  # GenerationOutput has what replay reads: prompt_ids, completion_ids, trace


@pytest.mark.parametrize("strategy,steps", [("static", 2), ("static", 4), ("dynamic", None), ("sequential", 4)])
def test_replay_reproduces_behaviour_logprobs(model, strategy, steps):
    eos = 7
    outs = generate(model, PROMPTS * 2, SamplingParams(max_tokens=11, strategy=strategy, steps=steps,
                                                       threshold=0.05, seed=3), eos_ids=[eos])
    rows = build_rows(as_samples(outs), 4, model.config.mask_token_id, pad_id=0)
    # a sequence costs at most max-steps-per-block rows
    assert rows.noisy.shape[0] <= sum(max(o.trace.steps) for o in outs)
    assert int(rows.target.sum()) == sum(len(o.completion_ids) for o in outs)
    with torch.no_grad():
        logits = model.forward_train(rows.noisy, rows.clean, rows.pos, rows.valid)
    lp = token_logprobs(logits, rows.clean, model.config.mask_token_id)
    old = rows.gather([o.trace.logprobs for o in outs])
    assert (lp - old)[rows.target].abs().max().item() < 1e-4


@pytest.mark.parametrize("strategy,steps,sampling", [
    ("static", 2, {}), ("dynamic", None, {"temperature": 0.7, "top_k": 20}), ("sequential", 4, {"top_p": 0.8})])
def test_trace_hidden_reproduces_the_sampling_distribution(model, strategy, steps, sampling):
    """The server's top logprobs (server.backends.native) go through the same replay: each
    completion token's logits, under the request's temperature / top-k / top-p, give its behaviour
    logprob, and the replay forward is the trainer's (same rows, same values)."""
    params = SamplingParams(max_tokens=11, strategy=strategy, steps=steps, threshold=0.05, seed=4, **sampling)
    outs = generate(model, PROMPTS, params, eos_ids=[7])
    mask = model.config.mask_token_id
    rows = build_rows(outs, 4, mask, pad_id=0)
    with torch.no_grad():
        trained = token_logprobs(model.forward_train(rows.noisy, rows.clean, rows.pos, rows.valid), rows.clean, mask)
    for i, o in enumerate(outs):
        with torch.no_grad():
            logits = model.lm_head(trace_hidden(model, o))
        assert logits.shape == (len(o.completion_ids), model.config.vocab_size)
        lp = sampling_logprobs(logits, params, mask).gather(-1, torch.tensor(o.completion_ids)[:, None])[:, 0]
        assert (lp - torch.tensor(o.trace.logprobs)).abs().max().item() < 1e-4
        at = rows.target & (rows.sample_idx == i)
        plain = token_logprobs(logits, torch.tensor(o.completion_ids), mask)[rows.token_idx[at]]
        assert (plain - trained[at]).abs().max().item() < 1e-5


def test_shrinkage_merges_steps(model):
    outs = generate(model, PROMPTS, SamplingParams(max_tokens=12, strategy="sequential", steps=4, seed=1))
    exact = build_rows(as_samples(outs), 4, model.config.mask_token_id, pad_id=0, shrink=1)
    merged = build_rows(as_samples(outs), 4, model.config.mask_token_id, pad_id=0, shrink=2)
    assert merged.noisy.shape[0] * 2 == exact.noisy.shape[0]
    assert int(merged.target.sum()) == int(exact.target.sum())
    with pytest.raises(ValueError, match="shrink"):
        build_rows(as_samples(outs), 4, 63, 0, shrink=0)


def test_completion_rows_cover_completion_tokens(model):
    outs = generate(model, PROMPTS, SamplingParams(max_tokens=6, seed=2))
    rows = completion_rows(as_samples(outs), 4, pad_id=0)
    assert rows.noisy.shape[0] == len(outs)
    assert rows.target.sum(1).tolist() == [len(o.completion_ids) for o in outs]


@pytest.mark.parametrize("chunk", [0, 1, 5, 64])
def test_chunked_logprobs_match_full_logits_values_and_gradients(chunk):
    """Chunked scoring (full-vocabulary logits for `chunk` tokens at a time, recomputed in
    backward) gives the values and gradients of the unchunked path."""
    from trainer.rl.replay import chunked_token_logprobs, token_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    hidden = torch.randn(23, 16, requires_grad=True)
    ids = torch.randint(0, 39, (23,))
    ref_lp = token_logprobs(head(hidden), ids, mask_id=39, temperature=0.7)
    ref_ent = token_entropy(head(hidden).detach(), 39)
    (ref_lp * torch.arange(23.0)).sum().backward()
    ref_gh, ref_gw = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    lp, ent, anchor = chunked_token_logprobs(head, hidden, ids, 39, temperature=0.7, chunk=chunk, num_chunks=30,
                                             filler=hidden[:1].detach())
    ((lp * torch.arange(23.0)).sum() + anchor).backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(hidden.grad, ref_gh)
    torch.testing.assert_close(head.weight.grad, ref_gw)


def test_chunked_logprobs_with_no_tokens_still_has_a_graph():
    from trainer.rl.replay import chunked_token_logprobs

    head = torch.nn.Linear(8, 10, bias=False)
    filler = torch.randn(1, 8, requires_grad=True)
    lp, _, anchor = chunked_token_logprobs(head, filler[:0], torch.zeros(0, dtype=torch.long), 9, chunk=4,
                                           num_chunks=2, filler=filler)
    assert lp.numel() == 0 and anchor.requires_grad and float(anchor) == 0.0
    anchor.backward()
    assert torch.count_nonzero(head.weight.grad) == 0
