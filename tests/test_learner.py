"""The learner's baseline path gives the same gradient as objectives.random_masking_loss."""

import torch

from trainer.config import TrainConfig
from trainer.learner import _policy_loss, baseline_rows
from trainer.objectives import random_masking_loss
from trainer.replay import Rows


def test_random_masking_baseline_matches_direct_loss():
    torch.manual_seed(0)
    B, L = 3, 8
    clean = torch.randint(0, 10, (B, L))
    target = torch.zeros(B, L, dtype=torch.bool)
    target[:, 3:7] = True
    target[2, 6] = False
    sidx = torch.where(target, torch.arange(B)[:, None].expand(B, L), -1)
    tidx = torch.where(target, torch.arange(L).expand(B, L) - 3, -1)
    rows = Rows(clean.clone(), clean, torch.arange(L).expand(B, L), torch.ones(B, L, dtype=torch.bool), target,
                sidx, tidx, torch.arange(B))
    masked, weights = baseline_rows(rows, "random_masking", mask_id=99, generator=torch.Generator().manual_seed(1))
    assert torch.equal(masked.noisy[masked.target], torch.full((int(masked.target.sum()),), 99))
    lp = torch.randn(B, L, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0])
    n_tok = masked.target.sum()
    loss, _ = _policy_loss(TrainConfig(objective="random_masking"), lp, lp.detach(),
                           adv[:, None] * weights * n_tok, masked.target, None, None)
    (g_learner,) = torch.autograd.grad(loss, lp)
    t = masked.target.sum(1).float() / target.sum(1).float()
    direct, _ = random_masking_loss(lp, masked.target, t, adv, target)
    (g_direct,) = torch.autograd.grad(direct, lp)
    assert torch.allclose(g_learner, g_direct, atol=1e-6)
