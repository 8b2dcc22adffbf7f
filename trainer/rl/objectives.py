"""RL losses on per-token log-probability tensors (no model here). Each returns (loss, metrics).

- `tracerl_loss`: PPO-clipped ratio per trace token (old = behaviour logprobs recorded in the
  trace), optional k3 KL to a reference, log-ratio clamping, per-token weights.
- `dipo_loss`: DiPO / GRPO: asymmetric clip [1 - eps_low, 1 + eps_high], k3 KL to a frozen
  reference.
- `random_mask` / `complementary_masks`: the masks of the random-masking and coupled
  baselines (diffu-GRPO / coupled-GRPO); the learner scores them through the same surrogate
  with their 1/t ELBO weights folded into the advantages (`trainer.rl.learner.baseline_rows`).
- `value_loss`: PPO-style clipped value loss.
- `OBJECTIVES`: the registry of `train.objective` (`@register_objective(name)` over a loss of the
  train config; the learner and the loop look the objective up there, no branches on its name).

Every loss is token-normalised (one sum over the mask / its count): the learner scales it to
the global mini-batch, and `train.norm=sequence` is the same surrogate with advantages scaled
by mean_len / len (one normalisation path). Shapes: B rows, L positions; `mask` [B,L] bool
marks scored tokens; advantages [B,L] or [B]. Metrics are python floats.

    loss, metrics = tracerl_loss(new_lp, old_lp, adv, mask, eps_clip=0.2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.config import TrainConfig

from trainer.objective_registry import (  # noqa: F401  (re-exported: the registry's home is torch-free)
    OBJECTIVES,
    ObjectiveSpec,
    objective_names,
    register_objective,
)

Metrics = dict[str, float]


def k3_kl(new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(new || ref): exp(ref - new) - (ref - new) - 1 >= 0."""
    d = ref_logprobs - new_logprobs
    return torch.exp(d) - d - 1


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x, mask: [B,L] -> scalar: the sum of x over mask divided by the mask's size."""
    xs = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return xs.sum() / mask.to(x.dtype).sum().clamp(min=1)


def _clipped_pg(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                mask: torch.Tensor, eps_low: float, eps_high: float, log_ratio_clip: float,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0, entropy: torch.Tensor | None = None,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Shared PPO surrogate over the tokens of `mask` [B,L]. Per token:
    max(-A r, -A clip(r, 1-eps_low, 1+eps_high)) * w + kl_coef * k3, token-normalised.
    Values outside mask never reach loss or grads."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=new_logprobs.dtype, device=new_logprobs.device)
    new_logprobs = torch.where(mask, new_logprobs, zero)  # padding may hold -inf / garbage
    old_logprobs = new_logprobs.detach() if old_logprobs is None else torch.where(mask, old_logprobs, zero)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(new_logprobs)  # [B] -> [B,L]
    advantages = torch.where(mask, advantages, zero)
    log_ratio = torch.clamp(new_logprobs - old_logprobs, -log_ratio_clip, log_ratio_clip)
    ratio = torch.exp(log_ratio)  # [B,L]
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(pg1, pg2)
    if weights is not None:
        per_token = per_token * weights
    metrics: Metrics = {}
    if ref_logprobs is not None and kl_coef != 0.0:
        kl = k3_kl(new_logprobs, torch.where(mask, ref_logprobs, zero))
        per_token = per_token + kl_coef * kl
        metrics["kl_ref"] = float(_masked_mean(kl.detach(), mask))
    loss = _masked_mean(per_token, mask)
    with torch.no_grad():
        r, a = ratio.detach(), advantages.detach()
        clipped = ((r > 1 + eps_high) & (a > 0)) | ((r < 1 - eps_low) & (a < 0))
        num = mask.sum()
        metrics["clip_frac"] = float(_masked_mean(clipped.float(), mask))
        metrics["approx_kl"] = float(_masked_mean((old_logprobs - new_logprobs).detach(), mask))
        metrics["ratio_mean"] = float(_masked_mean(r, mask))
        metrics["ratio_max"] = float(r[mask].max()) if num > 0 else 1.0
        metrics["pg_loss"] = float(loss.detach())
        if entropy is not None:
            metrics["entropy"] = float(_masked_mean(entropy.detach().float(), mask))
    return loss, metrics


def tracerl_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                 mask: torch.Tensor, eps_clip: float = 0.2, ref_logprobs: torch.Tensor | None = None,
                 kl_coef: float = 0.0, log_ratio_clip: float = 20.0, entropy: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """TraceRL policy loss. new/old/ref logprobs, mask: [B,L]; advantages [B,L] or [B];
    old = behaviour logprobs of the trace (None: on-policy, ratio 1); weights [B,L]: per-token
    factors of the surrogate (importance corrections)."""
    return _clipped_pg(new_logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip, log_ratio_clip,
                       ref_logprobs, kl_coef, entropy, weights=weights)


def dipo_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.28,
              ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
              log_ratio_clip: float = 20.0, entropy: torch.Tensor | None = None,
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """DiPO (GRPO for trace replay): asymmetric clip, k3 KL to reference."""
    return _clipped_pg(new_logprobs, old_logprobs, advantages, mask, eps_low, eps_high, log_ratio_clip,
                       ref_logprobs, kl_coef, entropy, weights=weights)


# ---------------------------------------------------------------- masked-diffusion baselines
def _mask_with_ratio(valid: torch.Tensor, ratio: torch.Tensor, generator: torch.Generator | None, lo_k: int,
                     hi_off: int) -> tuple[torch.Tensor, torch.Tensor]:
    """valid [B,L], ratio [B] -> (mask [B,L], t [B]): exactly k = clamp(round(ratio n), lo_k,
    n - hi_off) valid tokens per row, uniformly chosen; t = k / n (1.0 for empty rows)."""
    valid = valid.bool()
    n = valid.sum(dim=1)  # [B]
    k = torch.minimum(torch.clamp(torch.round(ratio * n).long(), min=lo_k), (n - hi_off).clamp(min=0))
    k = torch.minimum(k, n)
    scores = torch.rand(valid.shape, generator=generator, device=valid.device)
    scores = torch.where(valid, scores, torch.full_like(scores, 2.0))  # invalid sort last
    ranks = scores.argsort(dim=1).argsort(dim=1)  # [B,L] rank of each position
    mask = valid & (ranks < k[:, None])
    t = torch.where(n > 0, k.float() / n.clamp(min=1), torch.ones_like(ratio))
    return mask, t


def random_mask(valid: torch.Tensor, generator: torch.Generator | None = None, t_min: float = 0.1,
                t_max: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """valid [B,L] -> (mask [B,L] bool, t [B]): t ~ U(t_min, t_max) per row, then exactly
    round(t n) (>= 1) valid tokens masked; the returned t is the realised ratio k / n."""
    ratio = t_min + (t_max - t_min) * torch.rand(valid.shape[0], generator=generator, device=valid.device)
    return _mask_with_ratio(valid, ratio, generator, lo_k=1, hi_off=0)


def complementary_masks(valid: torch.Tensor, generator: torch.Generator | None = None, t_min: float = 0.2,
                        t_max: float = 0.8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """valid [B,L] -> (mask, complement [B,L] bool, t [B]): mask | complement == valid, disjoint;
    both non-empty when a row has >= 2 tokens. t = realised masked ratio of `mask`."""
    ratio = t_min + (t_max - t_min) * torch.rand(valid.shape[0], generator=generator, device=valid.device)
    mask, t = _mask_with_ratio(valid, ratio, generator, lo_k=1, hi_off=1)
    return mask, valid.bool() & ~mask, t


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2) -> tuple[torch.Tensor, Metrics]:
    """values, old_values, returns, mask: [B,L]. 0.5 * max((v - R)^2, (v_clip - R)^2), with
    v_clip = old + clamp(v - old, -clip, clip) (clip None: unclipped); token-normalised."""
    err = (values - returns) ** 2
    if clip is None:
        per_token, is_clipped = err, torch.zeros_like(mask, dtype=torch.bool)
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clip = (v_clip - returns) ** 2
        per_token, is_clipped = torch.maximum(err, err_clip), err_clip.detach() > err.detach()
    loss = 0.5 * _masked_mean(per_token, mask.bool())
    with torch.no_grad():
        m = mask.bool()
        resid = (returns - values)[m]
        var = returns[m].var(unbiased=False) if m.sum() > 1 else torch.zeros(())
        metrics = {"value_loss": float(loss.detach()),
                   "value_clip_frac": float(_masked_mean(is_clipped.float(), m)),
                   "value_mean": float(_masked_mean(values.detach(), m)),
                   "explained_var": float(1 - resid.var(unbiased=False) / var) if var > 0 else 0.0}
    return loss, metrics


# ---------------------------------------------------------------- the registry of train.objective
# (trainer/objective_registry.py: torch-free, so trainer.config reads the names without torch)
LossFn = Callable[..., tuple[torch.Tensor, Metrics]]  # (cfg, new_lp, old_lp, adv, mask, ref_lp, entropy, weights)
MaskFn = Callable[[torch.Tensor, "torch.Generator | None"], tuple[list[torch.Tensor], list[torch.Tensor]]]


def _one_mask(valid: torch.Tensor, generator: torch.Generator | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    mask, t = random_mask(valid, generator)
    return [mask], [t]


def _two_masks(valid: torch.Tensor, generator: torch.Generator | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    mask, comp, t = complementary_masks(valid, generator)
    return [mask, comp], [t, 1 - t]


@register_objective("tracerl")
@register_objective("random_masking", masks=_one_mask)  # on-policy (ratio 1): only the surrogate counts
@register_objective("coupled", masks=_two_masks)
def _tracerl(cfg: TrainConfig, new_lp: torch.Tensor, old_lp: torch.Tensor | None, adv: torch.Tensor, mask: torch.Tensor,
             ref_lp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """TraceRL's symmetric clip; the random-masking / coupled baselines share it (on-policy, with
    their 1/t ELBO weights and per-sequence normalisation folded into the advantages)."""
    return tracerl_loss(new_lp, old_lp, adv, mask, eps_clip=cfg.eps_clip, ref_logprobs=ref_lp, kl_coef=cfg.kl_coef,
                        log_ratio_clip=cfg.log_ratio_clip, entropy=entropy, weights=weights)


@register_objective("dipo")
def _dipo(cfg: TrainConfig, new_lp: torch.Tensor, old_lp: torch.Tensor | None, adv: torch.Tensor, mask: torch.Tensor,
          ref_lp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
          weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """DiPO's asymmetric clip [1 - eps_low, 1 + eps_high]."""
    return dipo_loss(new_lp, old_lp, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high, ref_logprobs=ref_lp,
                     kl_coef=cfg.kl_coef, log_ratio_clip=cfg.log_ratio_clip, entropy=entropy, weights=weights)
