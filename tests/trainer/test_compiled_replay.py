"""The replay forward + backward with compiled layers (SDARForCausalLM.compile_layers, the SDPA path on CPU):
one graph for a run of varying row counts and lengths, with activation checkpointing too; the same loss and
gradients as eager (fp32); rows padded to a length bucket (dllm.replay.pad_rows) change nothing."""

import torch
from torch._dynamo.utils import counters

from dllm.model import SDARForCausalLM
from dllm.replay import Rows, bucket_length, pad_rows, token_logprobs
from tests.helpers import tiny_config


def random_rows(rows: int, length: int, seed: int) -> Rows:
    """Replay-shaped rows: clean ids, a noisy copy with some positions masked (63), targets among those."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, 62, (rows, length), generator=g)
    masked = torch.rand(rows, length, generator=g) < 0.4
    valid = torch.ones(rows, length, dtype=torch.bool)
    valid[0, length - 3:] = False
    target = masked & valid
    idx = torch.full((rows, length), -1)
    return Rows(torch.where(masked, 63, clean), clean, torch.arange(length).expand(rows, length).contiguous(), valid,
                target, torch.where(target, 0, idx), torch.where(target, 0, idx), torch.zeros(rows, dtype=torch.long))


def loss_and_grads(model: SDARForCausalLM, r: Rows) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    hidden = model(r.noisy, position_ids=r.pos, clean_ids=r.clean, valid=r.valid, output="hidden")
    loss = -token_logprobs(model.lm_head(hidden[r.target]), r.clean[r.target], 63).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_compiled_replay_one_graph_over_lengths_equals_eager():
    torch.manual_seed(0)
    eager = SDARForCausalLM(tiny_config()).train()
    compiled = SDARForCausalLM(tiny_config()).train()
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_layers(backend="aot_eager")  # forward and backward traced (inductor: the benchmark)
    for i, (rows, length) in enumerate([(2, 8), (3, 20), (4, 36), (2, 16), (3, 64)]):
        compiled.gradient_checkpointing = eager.gradient_checkpointing = i >= 3  # the option, compiled too
        r = random_rows(rows, length, i)
        (la, ga), (lb, gb) = loss_and_grads(compiled, r), loss_and_grads(eager, r)
        assert torch.allclose(la, lb, atol=1e-5, rtol=1e-6)
        assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(ga, gb, strict=True))
        if i == 0:
            first = counters["stats"]["unique_graphs"]
    assert first == 1  # both layers share one graph
    assert counters["stats"]["unique_graphs"] <= 2  # + the checkpointed variant; none for new lengths


def test_padding_to_a_length_bucket_changes_nothing():
    torch.manual_seed(1)
    model = SDARForCausalLM(tiny_config()).train()
    r = random_rows(3, 20, 7)
    assert bucket_length(20, 4) == 64 and bucket_length(65, 4) == 128 and bucket_length(3, 48) == 96
    padded = pad_rows(r, bucket_length(20, 4), pad_id=0)
    assert padded.clean.shape == (3, 64) and not padded.valid[:, 20:].any() and not padded.target[:, 20:].any()
    (la, ga), (lb, gb) = loss_and_grads(model, r), loss_and_grads(model, padded)
    assert torch.allclose(la, lb, atol=1e-5, rtol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(ga, gb, strict=True))  # summation order
