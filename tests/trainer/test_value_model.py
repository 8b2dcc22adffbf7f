"""ValueModel: shapes, weights copied from the policy, gradients stay in the value model,
and a step of `value_loss` moves the values toward the returns."""

from __future__ import annotations

import pytest
import torch

from dllm.config import SDARConfig
from dllm.model import SDARForCausalLM
from trainer.rl.objectives import value_loss
from trainer.rl.value_model import ValueModel

B, L = 3, 8


def _config(**kw) -> SDARConfig:
    return SDARConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4,
                      mask_token_id=31, eos_token_id=0, torch_dtype="float32", **kw)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, 31, (B, L), generator=g)
    is_masked = torch.rand(B, L, generator=g) < 0.5
    noisy = torch.where(is_masked, torch.full_like(clean, 31), clean)
    pos = torch.arange(L).expand(B, L)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[0, -2:] = False
    return noisy, clean, pos, valid


@pytest.fixture
def policy() -> SDARForCausalLM:
    torch.manual_seed(0)
    return SDARForCausalLM(_config())


def test_shapes_and_copied_weights(policy):
    value = ValueModel(policy)
    noisy, clean, pos, valid = _batch()
    values = value(noisy, clean, pos, valid)
    assert values.shape == (B, L) and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0  # zero-initialised head
    pol = dict(policy.named_parameters())
    names = {n.removeprefix("backbone.") for n, _ in value.named_parameters()}
    assert "lm_head.weight" not in names and {"v_head.weight", "v_head.bias"} <= names
    for name, p in value.backbone.named_parameters():
        assert torch.equal(p, pol[name]) and p.data_ptr() != pol[name].data_ptr()
    # with a random head, values are a function of the policy's hidden states
    value.reset_head(std=0.1)
    _, hidden = policy.forward_train(noisy, clean, pos, valid, return_hidden=True)
    expected = hidden @ value.v_head.weight[0] + value.v_head.bias
    torch.testing.assert_close(value(noisy, clean, pos, valid), expected, atol=1e-5, rtol=1e-5)


def test_from_config_and_tied_embeddings():
    value = ValueModel(_config(tie_word_embeddings=True), head_init_std=0.02)
    noisy, clean, pos, valid = _batch()
    values = value(noisy, clean, pos, valid)
    assert values.shape == (B, L) and torch.isfinite(values).all() and values.abs().sum() > 0
    assert not any(n.startswith("backbone.lm_head") for n, _ in value.named_parameters())


def test_value_loss_step_only_trains_the_value_model(policy):
    value = ValueModel(policy, lr=1e-2)
    opt = value.optimizer
    noisy, clean, pos, valid = _batch(1)
    returns = torch.ones(B, L)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    old_values = value(noisy, clean, pos, valid).detach()
    first_loss = None
    for _ in range(3):
        loss, metrics = value_loss(value(noisy, clean, pos, valid), old_values, returns, valid, clip=None)
        first_loss = first_loss if first_loss is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None for p in policy.parameters())
        assert value.v_head.weight.grad.abs().sum() > 0
        opt.step()
    new_values = value(noisy, clean, pos, valid).detach()
    assert not torch.allclose(new_values, old_values)
    assert value_loss(new_values, old_values, returns, valid, clip=None)[0].item() < first_loss
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in value.backbone.parameters())
    for name, p in policy.named_parameters():
        assert torch.equal(p, before[name])


def test_load_backbone_rejects_wrong_shapes(policy):
    value = ValueModel(policy)
    bad = [(n, torch.zeros(1)) for n, _ in policy.named_parameters()]
    with pytest.raises(ValueError, match="shape mismatch"):
        value.load_backbone(bad)


def test_gradient_checkpointing_flag(policy):
    value = ValueModel(policy)
    value.gradient_checkpointing = True
    assert value.backbone.gradient_checkpointing
    value.train()
    noisy, clean, pos, valid = _batch()
    value.reset_head(std=0.1)
    value(noisy, clean, pos, valid).sum().backward()
    assert value.backbone.model.embed_tokens.weight.grad is not None


def test_save_load_restores_weights_and_optimizer(policy, tmp_path):
    value = ValueModel(policy, lr=1e-2, head_init_std=0.1)
    noisy, clean, pos, valid = _batch()
    value(noisy, clean, pos, valid).pow(2).mean().backward()
    value.optimizer.step()
    value.save(tmp_path / "value.pt")
    other = ValueModel(_config(), lr=1e-2)
    other.load(tmp_path / "value.pt")
    for (n, p), (_, q) in zip(value.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n
    assert other.optimizer.state_dict()["state"][0]["step"] == 1
    assert value.device == other.device == torch.device("cpu")


def test_bf16_policy_gives_fp32_value_model(policy):
    value = ValueModel(policy.to(torch.bfloat16))
    assert all(p.dtype == torch.float32 for p in value.parameters())
    assert value.optimizer is None


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("tied", [False, True])
def test_full_attention_value_model_is_bidirectional_over_the_replay_rows(family: str, tied: bool) -> None:
    """LLaDA / Dream: the family's backbone without its vocabulary projection, weights copied under the official
    names, values read where the policy scores each token (Dream's shift), every position seeing every other."""
    from dllm.embedded.full_folders import tiny_full_config
    from dllm.full.model import FullAttentionLM

    torch.manual_seed(0)
    policy = FullAttentionLM(tiny_full_config(family, block_size=4, tie_word_embeddings=tied))
    value = ValueModel(policy, lr=1e-3)
    head = {"llada": "model.transformer.ff_out.weight", "dream": "lm_head.weight"}[family]
    names = {n for n, _ in value.backbone.named_parameters()}
    assert names == {n for n, _ in policy.named_parameters()} - {head}
    pol = dict(policy.named_parameters())
    for name, p in value.backbone.named_parameters():
        assert torch.equal(p, pol[name]) and p.data_ptr() != pol[name].data_ptr()
    noisy, clean, pos, valid = _batch()
    noisy = noisy.clamp(max=policy.config.vocab_size - 1)
    assert torch.count_nonzero(value(noisy, clean, pos, valid)) == 0  # zero-initialised head
    value.reset_head(std=0.1)
    hidden = policy(noisy, position_ids=pos, valid=valid, output="hidden")
    expected = hidden @ value.v_head.weight[0] + value.v_head.bias
    got = value(noisy, clean, pos, valid)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    later = noisy.clone()
    later[:, -3] = (later[:, -3] + 1) % 10 + 1  # a later position changes an earlier value: full attention
    assert not torch.allclose(value(later, clean, pos, valid)[1, :3], got[1, :3])
    returns = torch.ones(B, L)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    loss, _ = value_loss(value(noisy, clean, pos, valid), got.detach(), returns, valid, clip=None)
    loss.backward()
    value.optimizer.step()
    assert all(p.grad is None for p in policy.parameters())
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
    assert value_loss(value(noisy, clean, pos, valid), got.detach(), returns, valid, clip=None)[0] < loss
