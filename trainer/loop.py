"""The online RL loop (slime style: one short function per step).

    dlrl train --config configs/tiny.yaml [num_steps=20 objective=dipo ...]

Each step: prompts -> rollouts with traces from the server(s) -> rewards -> advantages
(group z-score, or value model + step-wise GAE) -> optional zero-variance group filter
-> trace replay into training rows -> loss -> DeepSpeed step -> push version+1 into
every server in place (weight_sync) -> metrics.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from trainer.advantages import (
    filter_zero_variance_groups,
    group_advantages,
    sequence_to_token_rewards,
    stepwise_gae_batch,
)
from trainer.learner import baseline_rows
from trainer.replay import build_rows, completion_rows
from trainer.rewards import score_batch

log = logging.getLogger("dlrl.train")
BASELINES = ("random_masking", "coupled")


class Timer(dict):
    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self[f"time_{name}"] = self.get(f"time_{name}", 0.0) + time.perf_counter() - t0


def sequence_advantages(cfg, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """-> (advantage per sample [N], keep mask [N], fraction of groups filtered)."""
    adv = group_advantages(rewards, cfg.group_size)
    keep = torch.ones_like(rewards, dtype=torch.bool)
    frac = 0.0
    if cfg.filter_zero_variance:
        keep, frac = filter_zero_variance_groups(rewards, cfg.group_size)
    return adv, keep, float(frac)


def token_advantages(ctx, rows, samples, rewards, seq_adv) -> tuple[torch.Tensor, dict]:
    """Advantages at every row target [R, L]; with a value model also trains it (step-wise GAE)."""
    cfg = ctx.cfg
    if not cfg.use_value_model:
        per_sample = [torch.full((len(s.completion_ids),), float(seq_adv[i])) for i, s in enumerate(samples)]
        return rows.gather(per_sample) * _sequence_weights(cfg, rows, samples), {}
    values = ctx.learner.values(rows)  # [R, L]: V_j at the state that committed token j
    L = max(len(s.completion_ids) for s in samples)
    N = len(samples)
    tok_v = torch.zeros(N, L)
    step_ids = torch.zeros(N, L, dtype=torch.long)
    valid = torch.zeros(N, L, dtype=torch.bool)
    r, c = rows.target.nonzero(as_tuple=True)
    tok_v[rows.sample_idx[r, c], rows.token_idx[r, c]] = values[r, c]
    for i, s in enumerate(samples):
        P, B = len(s.prompt_ids), ctx.block_size
        step_ids[i, :len(s.steps)] = torch.tensor([((P + j) // B) * (B + 1) + st for j, st in enumerate(s.steps)])
        valid[i, :len(s.steps)] = True
    tok_r = sequence_to_token_rewards(rewards, step_ids, valid)
    returns, adv = stepwise_gae_batch(tok_r, tok_v, step_ids, valid, cfg.gamma, cfg.lam)
    row_adv = rows.gather([adv[i].float() for i in range(N)]) * _sequence_weights(cfg, rows, samples)
    row_ret = rows.gather([returns[i].float() for i in range(N)])
    vstats = ctx.learner.update_value(rows, values, row_ret)
    return row_adv, vstats


def _sequence_weights(cfg, rows, samples) -> torch.Tensor | float:
    """norm=sequence: weight each sample's tokens by mean_len / len, so every sequence counts
    equally under the token-normalised loss (the PPO surrogate is positively homogeneous in
    the advantage, so scaling advantages scales each token's term exactly)."""
    if cfg.norm != "sequence":
        return 1.0
    lens = torch.tensor([max(1, len(s.completion_ids)) for s in samples], dtype=torch.float32)
    scale = lens.mean() / lens  # [N]
    return torch.where(rows.target, scale[rows.sample_idx.clamp(min=0)], torch.zeros(()))


def rl_step(ctx, step: int) -> dict:
    """One RL step; returns its metrics."""
    cfg, t = ctx.cfg, Timer()
    with t("rollout"):
        batch = ctx.rollouts.get(ctx.version)
    with t("reward"):
        texts = [r.text for r in batch.rollouts]
        examples = [e for e in batch.examples for _ in range(cfg.group_size)]
        rewards = torch.tensor(score_batch(ctx.reward_fn, texts, examples,
                                           num_tokens=[len(r.completion_ids) for r in batch.rollouts]),
                               dtype=torch.float32)
    seq_adv, keep, frac_filtered = sequence_advantages(cfg, rewards)
    train_metrics: dict = {}
    samples = [s for s, k in zip(batch.samples(), keep) if k]
    if samples:
        kept_idx = keep.nonzero().squeeze(1)
        with t("replay"):
            weights = None
            if cfg.objective in BASELINES:  # random masks instead of trace states
                rows, weights = baseline_rows(completion_rows(samples, ctx.block_size, ctx.pad_id),
                                              cfg.objective, ctx.mask_id, ctx.generator)
            else:
                rows = build_rows(samples, ctx.block_size, ctx.mask_id, ctx.pad_id, cfg.shrink)
            old_lp = rows.gather([batch.rollouts[int(i)].logprobs for i in kept_idx])
        with t("train"):
            adv, vstats = token_advantages(ctx, rows, samples, rewards[kept_idx], seq_adv[kept_idx])
            train_metrics = ctx.learner.update(rows, old_lp, adv, weights) | vstats
    with t("sync"):
        if samples:  # weights changed: push them as version+1
            ctx.push()
    versions = [r.version for r in batch.rollouts]
    return {
        "step": step + 1, "version": ctx.version, **train_metrics, **t,
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": float((rewards >= 1.0).float().mean()),
        "frac_filtered_groups": frac_filtered, "num_rows": 0 if not samples else int(rows.noisy.shape[0]),
        "adv_mean": float(seq_adv[keep].mean()) if keep.any() else 0.0,
        "adv_abs_mean": float(seq_adv[keep].abs().mean()) if keep.any() else 0.0,
        "response_length": sum(len(r.completion_ids) for r in batch.rollouts) / len(batch.rollouts),
        "tokens_per_forward": _tokens_per_forward(batch.rollouts),
        "staleness": ctx.version - (1 if samples else 0) - min(versions), "rollout_version_min": min(versions),
    }


def _tokens_per_forward(rollouts) -> float:
    toks = sum(len(r.completion_ids) + len(r.trace.tail_ids) for r in rollouts)
    fwd = 0
    for r in rollouts:  # one forward per distinct (block, step)
        P, B = r.trace.prompt_len, r.trace.block_size
        fwd += len({((P + j) // B, s) for j, s in enumerate(r.trace.steps + r.trace.tail_steps)})
    return toks / max(1, fwd)


def train_loop(ctx) -> dict:
    """Run steps from ctx.start_step to cfg.num_steps; returns the last metrics."""
    cfg = ctx.cfg
    metrics: dict = {}
    for step in range(ctx.start_step, cfg.num_steps):
        metrics = rl_step(ctx, step)
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.num_steps):
            t0 = time.perf_counter()
            metrics["eval_accuracy"] = ctx.evaluate()
            metrics["time_eval"] = time.perf_counter() - t0
        metrics["time_step"] = sum(v for k, v in metrics.items() if k.startswith("time_") and k != "time_step")
        ctx.logger.log(step + 1, metrics)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            ctx.checkpoint(step + 1)
    return metrics
