"""Advantages: GRPO group z-scores, DAPO zero-variance filtering, TraceRL step-wise GAE.

- `group_advantages(rewards[N*G], G)`: A = (r - mean_group) / (std_group + eps)
  (`scale="none"`: just centred). Samples of one prompt are contiguous.
- `filter_zero_variance_groups(rewards, G)`: DAPO dynamic sampling; which groups carry no
  learning signal (all rewards equal) and the fraction of them.
- `stepwise_gae(token_rewards[L], token_values[L], token_step_ids[L], gamma, lam)`: step-wise
  GAE of TraceRL (arXiv 2509.06949, Prop. 1) for a diffusion value model. A token's step is
  the global index of the denoising forward that committed it (ordered by block, then step
  within block); tokens may come in any order. With step aggregates
  r*_t = mean_{t(j)=t} r_j and V*_t = mean_{t(j)=t} V_j:
      R*_t = r*_t + g R*_{t+1},   d*_t = r*_t - V*_t + g V*_{t+1},   A*_t = d*_t + g l A*_{t+1}
      R_j  = r_j + g R*_{t(j)+1}, A_j  = r_j - V_j + g V*_{t(j)+1} + g l A*_{t(j)+1}
  (zero beyond the last step). Step ids need not be contiguous: empty steps are skipped
  (the "next step" is the next step that committed a token).
  `stepwise_gae_batch(..., valid[B,L])` does a batch; `sequence_to_token_rewards` puts a
  sequence reward on the tokens of its last step (so r*_T = R).

    adv = group_advantages(torch.tensor(rewards), group_size=8)
    returns, adv = stepwise_gae_batch(tok_r, values, step_ids, valid, gamma=1.0, lam=1.0)
    returns, adv = trace_gae(traces, values, rewards, shrink=2, gamma=1.0, lam=0.95)   # from traces

`trace_gae` takes each sample's step ids from its trace (`Trace.global_steps(shrink)`:
with shrinkage s, steps (k-1)s+1..ks of a block are one step of the shrunk trajectory, as in
TraceRL) and puts the sequence reward on the tokens of the last step.

`ADVANTAGE_ESTIMATORS`: the registry of the token-level estimators the loop uses
(`@register_advantage(name)`; `advantage_estimator(cfg)` picks one: `gae` with
`train.use_value_model`, else `group`; trainer.loop registers both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dllm.trace import Trace
    from trainer.config import TrainConfig

# (run, rows, samples, rewards [N], sequence advantages [N], row mini-batches [R], weights) -> (adv [R,L], metrics)
AdvantageFn = Callable[..., tuple[torch.Tensor, dict]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: `@register_advantage("name")` adds a token-level advantage estimator."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


def advantage_estimator(cfg: TrainConfig) -> str:
    """The estimator a train config asks for: TraceRL's value model + step-wise GAE, or group z-scores."""
    return "gae" if cfg.use_value_model else "group"


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                     scale: str = "std") -> torch.Tensor:
    """rewards: [N*G] -> advantages [N*G]. std is the unbiased group std; a group whose
    rewards are all equal (or G == 1) gets advantage 0."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale: expected 'std' or 'none', got {scale!r}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size: {rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # [N, G]
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "none" or group_size == 1:
        return centred.view(-1)
    std = r.std(dim=1, keepdim=True)  # [N, 1]
    scaled = centred / (std + eps).clamp(min=torch.finfo(r.dtype).tiny)
    return torch.where(std > 0, scaled, torch.zeros_like(scaled)).view(-1)  # all-equal group -> 0


def zero_variance_groups(rewards: torch.Tensor, group_size: int, atol: float = 0.0) -> torch.Tensor:
    """rewards: [N*G] -> is_zero_variance [N] bool (max - min <= atol within the group)."""
    r = rewards.float().view(-1, group_size)  # [N, G]
    return (r.max(dim=1).values - r.min(dim=1).values) <= atol


def filter_zero_variance_groups(rewards: torch.Tensor, group_size: int,
                                atol: float = 0.0) -> tuple[torch.Tensor, float]:
    """-> (keep [N*G] bool: samples of groups with reward variance, fraction of groups dropped)."""
    is_zero = zero_variance_groups(rewards, group_size, atol)  # [N]
    keep = (~is_zero).repeat_interleave(group_size)  # [N*G]
    frac = float(is_zero.float().mean()) if is_zero.numel() else 0.0
    return keep, frac


def sequence_to_token_rewards(seq_rewards: torch.Tensor, step_ids: torch.Tensor,
                              valid: torch.Tensor) -> torch.Tensor:
    """seq_rewards [B], step_ids [B,L], valid [B,L] -> token rewards [B,L]: R on every valid
    token of the sequence's last step, 0 elsewhere."""
    neg = torch.full_like(step_ids, -1)
    last = torch.where(valid, step_ids, neg).max(dim=1, keepdim=True).values  # [B, 1]
    is_last = valid & (step_ids == last)
    return torch.where(is_last, seq_rewards.float()[:, None], torch.zeros((), dtype=torch.float32))


def _dense_step_ranks(step_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, int]:
    """step_ids [B,L] (any ints) -> ranks [B,L] in 0..T_b-1 per row (0 on invalid), max T."""
    ranks = torch.zeros_like(step_ids, dtype=torch.long)
    num_steps = 0
    for b in range(step_ids.shape[0]):
        ids = step_ids[b][valid[b]]
        if ids.numel():
            uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
            ranks[b][valid[b]] = inv
            num_steps = max(num_steps, uniq.numel())
    return ranks, num_steps


def stepwise_gae_batch(token_rewards: torch.Tensor, token_values: torch.Tensor,
                       token_step_ids: torch.Tensor, valid: torch.Tensor, gamma: float = 1.0,
                       lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """token_rewards, token_values: [B,L] float; token_step_ids: [B,L] int; valid: [B,L] bool.
    -> (returns [B,L], advantages [B,L]), zero where not valid. No gradient flows."""
    if not (token_rewards.shape == token_values.shape == token_step_ids.shape == valid.shape):
        raise ValueError(f"stepwise_gae: shapes differ: rewards {tuple(token_rewards.shape)}, values "
                         f"{tuple(token_values.shape)}, steps {tuple(token_step_ids.shape)}, valid {tuple(valid.shape)}")
    valid = valid.bool()
    r = torch.where(valid, token_rewards.detach().double(), 0.0)  # [B, L]
    v = torch.where(valid, token_values.detach().double(), 0.0)  # [B, L]
    ranks, num_steps = _dense_step_ranks(token_step_ids, valid)  # [B, L], T
    B = r.shape[0]
    # Step aggregates, with one extra zero step at T: [B, T+1]
    count = torch.zeros(B, num_steps + 1, dtype=torch.float64).scatter_add_(1, ranks, valid.double())
    r_step = torch.zeros_like(count).scatter_add_(1, ranks, r) / count.clamp(min=1)
    v_step = torch.zeros_like(count).scatter_add_(1, ranks, v) / count.clamp(min=1)
    ret_step = torch.zeros_like(count)  # R*_t
    adv_step = torch.zeros_like(count)  # A*_t
    for t in range(num_steps - 1, -1, -1):
        ret_step[:, t] = r_step[:, t] + gamma * ret_step[:, t + 1]
        delta = r_step[:, t] - v_step[:, t] + gamma * v_step[:, t + 1]
        adv_step[:, t] = delta + gamma * lam * adv_step[:, t + 1]
    nxt = ranks + 1  # [B, L]
    returns = r + gamma * ret_step.gather(1, nxt)
    advantages = r - v + gamma * v_step.gather(1, nxt) + gamma * lam * adv_step.gather(1, nxt)
    dtype = token_rewards.dtype if token_rewards.is_floating_point() else torch.float32
    zero = torch.zeros((), dtype=torch.float64)
    return (torch.where(valid, returns, zero).to(dtype), torch.where(valid, advantages, zero).to(dtype))


def stepwise_gae(token_rewards: torch.Tensor, token_values: torch.Tensor, token_step_ids: torch.Tensor,
                 gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: token_rewards, token_values, token_step_ids: [L] -> (returns [L], advantages [L])."""
    valid = torch.ones_like(token_step_ids, dtype=torch.bool)
    returns, adv = stepwise_gae_batch(token_rewards[None], token_values[None], token_step_ids[None],
                                      valid[None], gamma, lam)
    return returns[0], adv[0]


def trace_gae(traces: Sequence[Trace], token_values: torch.Tensor, rewards: torch.Tensor, shrink: int = 1, gamma: float = 1.0,
              lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """traces: N objects with `global_steps(shrink)` (dllm.trace.Trace); token_values
    [N, L] (V_j of completion token j); rewards [N]. -> (returns [N, L], advantages [N, L])."""
    N, L = token_values.shape
    step_ids = torch.zeros(N, L, dtype=torch.long)
    valid = torch.zeros(N, L, dtype=torch.bool)
    for i, tr in enumerate(traces):
        ids = tr.global_steps(shrink)
        step_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        valid[i, :len(ids)] = True
    tok_r = sequence_to_token_rewards(rewards, step_ids, valid)
    return stepwise_gae_batch(tok_r, token_values, step_ids, valid, gamma, lam)
