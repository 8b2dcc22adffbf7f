"""The learner's baseline path (random masks from `baseline_rows`, 1/t ELBO weights folded into
the advantages, the shared clipped surrogate) against the masked-diffusion baseline losses
written out as loops: diffu-GRPO's random masking and coupled-GRPO's complementary masks."""

import torch

from dllm.replay import Rows
from trainer.config import TrainConfig
from trainer.rl.learner import _policy_loss, baseline_rows

B, L, START = 3, 8, 3  # completions at positions 3..6 (row 2 one shorter)


def _rows() -> Rows:
    torch.manual_seed(0)
    clean = torch.randint(0, 10, (B, L))
    target = torch.zeros(B, L, dtype=torch.bool)
    target[:, START:7] = True
    target[2, 6] = False
    sidx = torch.where(target, torch.arange(B)[:, None].expand(B, L), -1)
    tidx = torch.where(target, torch.arange(L).expand(B, L) - START, -1)
    return Rows(clean.clone(), clean, torch.arange(L).expand(B, L), torch.ones(B, L, dtype=torch.bool), target,
                sidx, tidx, torch.arange(B))


def _learner_grad(objective: str, rows: Rows, lp: torch.Tensor, adv: torch.Tensor, seed: int):
    """Gradient of the learner's loss w.r.t. the log-probs of its (mask, [complement]) rows."""
    masked, weights = baseline_rows(rows, objective, mask_id=99, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(masked.noisy[masked.target], torch.full((int(masked.target.sum()),), 99))
    n_tok = masked.target.sum()
    a = adv[masked.row_sample][:, None] * weights * n_tok
    loss, _ = _policy_loss(TrainConfig(objective=objective), lp, lp.detach(), a, masked.target, None, None)
    return torch.autograd.grad(loss, lp)[0], masked


def test_random_masking_baseline_matches_the_reference_loss():
    rows = _rows()
    lp = torch.randn(B, L, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0])
    g, masked = _learner_grad("random_masking", rows, lp, adv, seed=1)
    n = rows.target.sum(1).float()
    t = masked.target.sum(1).float() / n
    # reference: per sequence, sum over masked tokens of (1/t) * (-A) * ratio / response tokens; mean
    ref = 0.0
    for b in range(B):
        s = sum((1 / t[b]) * (-adv[b]) * torch.exp(lp[b, j] - lp[b, j].detach()) for j in range(L)
                if masked.target[b, j])
        ref = ref + s / n[b]
    (g_ref,) = torch.autograd.grad(ref / B, lp)
    assert torch.allclose(g, g_ref, atol=1e-6)


def test_coupled_baseline_matches_the_reference_loss():
    rows = _rows()
    lp = torch.randn(2 * B, L, requires_grad=True)  # rows 0..B-1: mask copy; B..2B-1: complement copy
    adv = torch.tensor([0.7, -1.0, 1.5])
    g, masked = _learner_grad("coupled", rows, lp, adv, seed=4)
    mask, comp = masked.target[:B], masked.target[B:]
    assert torch.equal(mask | comp, rows.target) and not (mask & comp).any()
    n = rows.target.sum(1).float()
    t = mask.sum(1).float() / n
    ref = 0.0
    for b in range(B):
        s = 0.0
        for j in range(L):
            if mask[b, j]:
                s = s + 0.5 / t[b] * (-adv[b]) * torch.exp(lp[b, j] - lp[b, j].detach())
            elif comp[b, j]:
                s = s + 0.5 / (1 - t[b]) * (-adv[b]) * torch.exp(lp[B + b, j] - lp[B + b, j].detach())
        ref = ref + s / n[b]
    (g_ref,) = torch.autograd.grad(ref / B, lp)
    assert torch.allclose(g, g_ref, atol=1e-6)
    assert (g[:B][~mask] == 0).all() and (g[B:][~comp] == 0).all()


def test_biased_rollouts_score_as_sampled_tis_weights_one():
    """Rollouts generated with a logit_bias: the learner's log-probs (chunked, the trace's bias added) equal the
    behaviour log-probs, so TIS weights are exactly 1 on-policy; selections and baseline rows keep the bias."""
    from types import SimpleNamespace

    from dllm.model import SDARForCausalLM
    from dllm.replay import build_rows
    from dllm.runner import BlockRunner
    from dllm.sampling import SamplingParams
    from tests.helpers import drive, tiny_config
    from trainer.infra.dist import Ranks
    from trainer.rl.correction import is_weights
    from trainer.rl.learner import Learner, _select

    torch.manual_seed(0)
    model = SDARForCausalLM(tiny_config()).eval()
    runner = BlockRunner(model, max_batch=4, max_len=32, eos_ids=[0], num_pages=16)
    reqs = [([5, 6, 7], SamplingParams(max_tokens=8, seed=s, ignore_eos=True, strategy="static", steps=2,
                                       logit_bias={3: 4.0, 42: -3.0} if s else None)) for s in range(3)]
    seqs = drive(runner, reqs, 3)
    rows = build_rows(seqs, 4, 63, pad_id=0)
    cfg = SimpleNamespace(logprob_chunk=5, temperature=1.0)
    learner = Learner(cfg, Ranks(), SimpleNamespace(module=model), mask_id=63)
    with torch.no_grad():
        lp, _, _ = learner._logprobs(model, rows)
    old = rows.gather([s.trace.logprobs for s in seqs])
    assert (lp - old)[rows.target].abs().max() < 1e-4
    w, _ = is_weights(lp - old, rows.target, rows.sample_idx, "tis", "token", cap=2.0)
    assert torch.allclose(w[rows.target], torch.ones(int(rows.target.sum())), atol=1e-4)
    part = _select(rows, torch.tensor([0, len(rows.row_sample) - 1]))
    assert part.bias is not None and part.bias.shape[0] == 2
    masked, _ = baseline_rows(rows, "coupled", mask_id=63, generator=torch.Generator().manual_seed(0))
    assert masked.bias is not None and masked.bias.shape[0] == masked.noisy.shape[0]
