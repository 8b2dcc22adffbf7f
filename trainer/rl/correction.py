"""Train-serve mismatch: how far the trainer's log-probabilities are from the server's, and the
importance corrections production RL stacks use for it.

The server samples (often in bf16, with its own kernels) and records the behaviour log-prob
of every token; the trainer recomputes it (fp32, other kernels). With identical weights the
two differ by numerical noise, so a PPO ratio against the behaviour log-probs partly clips on
noise. With `train.is_correction`, the learner recomputes the old log-probs with its own
weights before the update (PPO ratio = new / old_trainer) and weights each token's surrogate
by the importance ratio rho = exp(old_trainer - behaviour):

- `tis` (truncated importance sampling): w = min(rho, cap);
- `mis` (masked importance sampling): w = rho where 1/cap <= rho <= cap, else 0 (token dropped);

at `token` level (rho per token) or `sequence` level (rho = exp(sum over the sample's tokens)).

    d = old_trainer - behaviour                                         # [R, L] at targets
    w, stats = is_weights(d, rows.target, rows.sample_idx, "tis", "token", cap=2.0)
"""

from __future__ import annotations

import typing
from typing import Literal

import torch

Mode = Literal["none", "tis", "mis"]  # train.is_correction
Level = Literal["token", "sequence"]  # train.is_level
MODES, LEVELS = typing.get_args(Mode), typing.get_args(Level)


def mismatch_stats(trainer_lp: torch.Tensor, behaviour_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |log ratio| between trainer and behaviour log-probs over `mask` [R, L]."""
    d = (trainer_lp.detach() - behaviour_lp).abs()[mask.bool()]
    if d.numel() == 0:
        return {}
    return {"mismatch_abs_mean": float(d.mean()), "mismatch_abs_max": float(d.max())}


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, sample_idx: torch.Tensor, mode: str, level: str,
               cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """log_ratio [R, L] = old_trainer - behaviour; mask [R, L] scored tokens; sample_idx [R, L]
    (the sample each token belongs to). -> (weights [R, L], metrics)."""
    if mode not in MODES or level not in LEVELS or cap < 1:
        raise ValueError(f"is_correction={mode!r}, is_level={level!r}, is_cap={cap}: expected one of {MODES}, "
                         f"one of {LEVELS} and a cap >= 1")
    mask = mask.bool()
    d = torch.where(mask, log_ratio.double(), 0.0)
    if level == "sequence":
        num = int(sample_idx.max()) + 1 if mask.any() else 0
        per_sample = torch.zeros(num, dtype=torch.float64).index_add_(0, sample_idx[mask], d[mask])
        d = torch.where(mask, per_sample[sample_idx.clamp(min=0)], 0.0)
    rho = torch.exp(d.clamp(max=50.0))
    if mode == "tis":
        w = rho.clamp(max=cap)
    elif mode == "mis":
        w = torch.where((rho >= 1.0 / cap) & (rho <= cap), rho, torch.zeros_like(rho))
    else:
        w = torch.ones_like(rho)
    w = torch.where(mask, w, 0.0).float()
    n = int(mask.sum())
    stats = {} if n == 0 else {"is_weight_mean": float(w[mask].mean()),
                               "is_dropped_frac": float((w[mask] == 0).float().mean()),
                               "is_truncated_frac": float((rho[mask] > cap).float().mean())}
    return w, stats
