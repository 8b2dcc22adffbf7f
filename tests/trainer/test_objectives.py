"""Tests for trainer.rl.objectives: each loss and its gradient against loop-based references."""

import math

import pytest
import torch

from dlrl_config import ConfigError, build
from trainer.config import TrainConfig
from trainer.rl.learner import _policy_loss
from trainer.rl.objectives import (
    OBJECTIVES,
    complementary_masks,
    dipo_loss,
    k3_kl,
    objective_names,
    random_mask,
    register_objective,
    tracerl_loss,
    value_loss,
)

DT = torch.float64


def _ref_surrogate(new, old, adv, eps_low, eps_high, c):
    """One token (0-d tensors): max(-A r, -A clip(r)) with r = exp(clamp(new - old, -c, c))."""
    ratio = torch.exp(torch.clamp(new - old, -c, c))
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))


def _ref_loss(new, old, adv, mask, eps_low, eps_high, c=20.0, ref=None, kl_coef=0.0, norm="token"):
    """Loop over b, l; per-token surrogate (+ k3 KL), token or sequence normalisation."""
    B, L = new.shape
    total, count, seq_means = 0.0, 0, []
    for b in range(B):
        s, n = 0.0, 0
        for j in range(L):
            if not mask[b, j]:
                continue
            a = adv[b] if adv.dim() == 1 else adv[b, j]
            term = _ref_surrogate(new[b, j], old[b, j], a, eps_low, eps_high, c)
            if ref is not None:
                d = ref[b, j] - new[b, j]
                term = term + kl_coef * (torch.exp(d) - d - 1)
            s, n = s + term, n + 1
        total, count = total + s, count + n
        if n:
            seq_means.append(s / n)
    return total / count if norm == "token" else sum(seq_means) / len(seq_means)


def _batch(seed=0, B=3, L=6):
    g = torch.Generator().manual_seed(seed)
    new = (torch.randn(B, L, generator=g, dtype=DT) * 0.3 - 1.0).requires_grad_(True)
    old = new.detach() + torch.randn(B, L, generator=g, dtype=DT) * 0.3
    ref = new.detach() + torch.randn(B, L, generator=g, dtype=DT) * 0.2
    adv = torch.randn(B, L, generator=g, dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)[:B]
    return new, old, ref, adv, mask


def _grad(loss, x):
    return torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_tracerl_loss_and_grad_match_reference(kl_coef):
    new, old, ref, adv, mask = _batch()
    loss, m = tracerl_loss(new, old, adv, mask, eps_clip=0.2, ref_logprobs=ref, kl_coef=kl_coef)
    expected = _ref_loss(new, old, adv, mask, 0.2, 0.2, ref=ref, kl_coef=kl_coef)
    assert torch.allclose(loss, expected)
    assert torch.allclose(_grad(loss, new), _grad(expected, new))
    assert ("kl_ref" in m) == (kl_coef > 0)


def test_tracerl_sequence_advantages_and_padding_garbage():
    new, old, _, _, mask = _batch(1)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=DT)
    garbage_old = torch.where(mask, old, torch.full_like(old, -math.inf))
    loss, _ = tracerl_loss(new, garbage_old, adv, mask)
    expected = _ref_loss(new, old, adv, mask, 0.2, 0.2)
    assert torch.allclose(loss, expected)
    grad = _grad(loss, new)
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()


def test_sequence_normalisation_is_advantages_scaled_by_mean_len_over_len():
    """train.norm=sequence: the token-normalised surrogate with advantages x mean_len / len equals
    the per-sequence mean (the one normalisation path, for any ratio since the clipped surrogate
    is positively homogeneous in A)."""
    new, old, _, adv, mask = _batch(7)
    lens = mask.sum(1).to(DT)
    scaled = adv * (lens.mean() / lens)[:, None]
    loss, _ = tracerl_loss(new, old, scaled, mask)
    expected = _ref_loss(new, old, adv, mask, 0.2, 0.2, norm="sequence")
    assert torch.allclose(loss, expected)
    assert torch.allclose(_grad(loss, new), _grad(expected, new))


@pytest.mark.parametrize("adv, ratio, clipped", [
    (1.0, 1.15, False), (1.0, 1.2 - 1e-6, False), (1.0, 1.2 + 1e-6, True), (1.0, 1.5, True),
    (1.0, 0.5, False),  # A > 0: only ratios above 1 + eps are clipped
    (-1.0, 0.85, False), (-1.0, 0.8 + 1e-6, False), (-1.0, 0.8 - 1e-6, True), (-1.0, 0.5, True),
    (-1.0, 1.5, False),  # A < 0: only ratios below 1 - eps are clipped
])
def test_clipping_at_boundaries(adv, ratio, clipped):
    new = torch.tensor([[math.log(ratio)]], dtype=DT, requires_grad=True)
    old = torch.zeros(1, 1, dtype=DT)
    loss, m = tracerl_loss(new, old, torch.tensor([adv], dtype=DT), torch.ones(1, 1, dtype=torch.bool), eps_clip=0.2)
    g = _grad(loss, new).item()
    if clipped:
        assert g == 0.0 and m["clip_frac"] == 1.0
        assert loss.item() == pytest.approx(-adv * (1.2 if adv > 0 else 0.8))
    else:
        assert g == pytest.approx(-adv * ratio) and m["clip_frac"] == 0.0
        assert loss.item() == pytest.approx(-adv * ratio)


def test_log_ratio_clamp():
    new = torch.tensor([[30.0]], dtype=DT, requires_grad=True)
    loss, m = tracerl_loss(new, torch.zeros(1, 1, dtype=DT), torch.tensor([-1.0], dtype=DT),
                           torch.ones(1, 1, dtype=torch.bool), log_ratio_clip=5.0)
    assert loss.item() == pytest.approx(math.exp(5.0))  # -A * exp(clamped log-ratio), finite
    assert _grad(loss, new).item() == 0.0
    assert m["ratio_max"] == pytest.approx(math.exp(5.0))


def test_dipo_asymmetric_clip_and_kl():
    new, old, ref, adv, mask = _batch(3)
    loss, m = dipo_loss(new, old, adv, mask, eps_low=0.1, eps_high=0.3, ref_logprobs=ref, kl_coef=0.05)
    expected = _ref_loss(new, old, adv, mask, 0.1, 0.3, ref=ref, kl_coef=0.05)
    assert torch.allclose(loss, expected)
    assert torch.allclose(_grad(loss, new), _grad(expected, new))
    # ratio 1.25, A > 0: clipped by symmetric eps 0.2 but not by eps_high 0.28
    x = torch.tensor([[math.log(1.25)]], dtype=DT, requires_grad=True)
    one = (torch.zeros(1, 1, dtype=DT), torch.tensor([1.0], dtype=DT), torch.ones(1, 1, dtype=torch.bool))
    assert _grad(dipo_loss(x, *one)[0], x).item() == pytest.approx(-1.25)
    assert _grad(tracerl_loss(x, *one)[0], x).item() == 0.0


def test_k3_kl_value_and_grad():
    new = torch.tensor([-1.0, -2.0, -0.5], dtype=DT, requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -2.0], dtype=DT)
    kl = k3_kl(new, ref)
    d = (ref - new).detach()
    assert torch.allclose(kl, torch.exp(d) - d - 1) and kl[0] == 0 and (kl >= 0).all()
    assert torch.allclose(_grad(kl.sum(), new), 1 - torch.exp(d))


def test_metrics():
    new = torch.log(torch.tensor([[1.0, 1.5, 0.5, 9.0]], dtype=DT))
    old = torch.zeros(1, 4, dtype=DT)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    ent = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    _, m = tracerl_loss(new, old, adv, mask, eps_clip=0.2, entropy=ent)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["ratio_mean"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.5)
    assert m["approx_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3)
    assert m["entropy"] == pytest.approx(2.0)


def test_random_mask_properties():
    valid = torch.tensor([[1] * 10, [1] * 3 + [0] * 7, [0] * 10, [1] + [0] * 9]).bool()
    mask, t = random_mask(valid, torch.Generator().manual_seed(0))
    mask2, t2 = random_mask(valid, torch.Generator().manual_seed(0))
    assert torch.equal(mask, mask2) and torch.equal(t, t2)  # seeded
    assert not (mask & ~valid).any()
    n = valid.sum(1)
    assert (mask.sum(1)[n > 0] >= 1).all() and mask[2].sum() == 0 and t[2] == 1.0
    assert torch.allclose(t[n > 0], mask.sum(1)[n > 0].float() / n[n > 0])


def test_complementary_masks_partition():
    valid = torch.ones(64, 9, dtype=torch.bool)
    valid[::3, 5:] = False
    mask, comp, t = complementary_masks(valid, torch.Generator().manual_seed(1))
    assert not (mask & comp).any() and torch.equal(mask | comp, valid)
    assert (mask.sum(1) >= 1).all() and (comp.sum(1) >= 1).all()
    assert torch.allclose(t, mask.sum(1).float() / valid.sum(1))
    assert ((t > 0) & (t < 1)).all()


def test_random_mask_one_over_t_estimator_is_unbiased():
    # E_mask[(1/t) sum_{j in M} x_j / n] = mean(x) (per-row log-likelihood average).
    x = torch.linspace(-2.0, 0.0, 8)
    valid = torch.ones(4000, 8, dtype=torch.bool)
    mask, t = random_mask(valid, torch.Generator().manual_seed(2))
    est = ((mask * x).sum(1) / t / 8).mean()
    assert est.item() == pytest.approx(x.mean().item(), abs=0.03)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_reference(clip):
    g = torch.Generator().manual_seed(6)
    values = torch.randn(2, 5, generator=g, dtype=DT, requires_grad=True)
    old_values = values.detach() + torch.randn(2, 5, generator=g, dtype=DT) * 0.5
    returns = torch.randn(2, 5, generator=g, dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    loss, m = value_loss(values, old_values, returns, mask, clip=clip)
    terms = []
    for b in range(2):
        for j in range(5):
            if mask[b, j]:
                e = (values[b, j] - returns[b, j]) ** 2
                if clip is not None:
                    vc = old_values[b, j] + torch.clamp(values[b, j] - old_values[b, j], -clip, clip)
                    e = torch.maximum(e, (vc - returns[b, j]) ** 2)
                terms.append(e)
    expected = 0.5 * sum(terms) / len(terms)
    assert torch.allclose(loss, expected)
    assert torch.allclose(_grad(loss, values), _grad(expected, values))
    assert 0.0 <= m["value_clip_frac"] <= 1.0 and (clip is not None or m["value_clip_frac"] == 0.0)


def test_value_loss_clip_blocks_gradient_far_from_old():
    values = torch.tensor([[2.0]], dtype=DT, requires_grad=True)
    loss, m = value_loss(values, torch.zeros(1, 1, dtype=DT), torch.tensor([[3.0]], dtype=DT),
                         torch.ones(1, 1, dtype=torch.bool), clip=0.5)
    assert loss.item() == pytest.approx(0.5 * 2.5**2) and _grad(loss, values).item() == 0.0
    assert m["value_clip_frac"] == 1.0


def test_objective_names():
    assert objective_names() == ("tracerl", "dipo", "random_masking", "coupled")


def test_the_learner_takes_each_objective_from_the_registry():
    lp = torch.randn(2, 5, dtype=DT, requires_grad=True)
    old, adv, mask = lp.detach() + 0.3, torch.tensor([1.0, -1.0], dtype=DT), torch.ones(2, 5, dtype=torch.bool)
    cfg = TrainConfig(objective="dipo", eps_low=0.1, eps_high=0.5)
    got, _ = _policy_loss(cfg, lp, old, adv, mask, None, None)
    want, _ = dipo_loss(lp, old, adv, mask, eps_low=0.1, eps_high=0.5, log_ratio_clip=cfg.log_ratio_clip)
    assert got.item() == pytest.approx(want.item())
    seen = []

    @register_objective("test_only_objective")
    def _loss(cfg, new_lp, old_lp, adv, mask, ref_lp=None, entropy=None, weights=None):
        seen.append(cfg.kl_coef)
        return new_lp.sum() * 0, {}

    try:
        assert OBJECTIVES["test_only_objective"].loss is _loss and OBJECTIVES["test_only_objective"].masks is None
        _policy_loss(cfg.model_copy(update={"objective": "test_only_objective"}), lp, old, adv, mask, None, None)
        assert seen == [cfg.kl_coef]
        with pytest.raises(ValueError, match="already registered"):
            register_objective("dipo")(_loss)
    finally:
        del OBJECTIVES["test_only_objective"]


def test_an_unknown_objective_is_a_config_error_naming_the_registered_ones():
    with pytest.raises(ConfigError) as e:
        build(TrainConfig, {"objective": "ppo"}, "train")
    assert "train.objective" in str(e.value)
    assert all(name in str(e.value) for name in objective_names())
