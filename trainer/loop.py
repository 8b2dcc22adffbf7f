"""The online RL loop (slime style: one short function per step), data-parallel over ranks.

    dlrl train --config configs/tiny.yaml [num_steps=20 objective=dipo nproc=2 ...]

Each step: servers checked -> this rank's prompts -> rollouts with traces -> rewards ->
advantages (group z-score, or value model + step-wise GAE) -> optional zero-variance group
filter -> trace replay into training rows -> loss -> DeepSpeed step (gradients averaged over
ranks, losses normalised by global token counts) -> push version+1 into every server in place
(rank 0; weight_sync) -> metrics reduced over ranks (rank 0 logs).

This module is what a run DOES (functions of a `trainer.run.Run`, which holds what it IS); the
objective and the advantage estimator come from their registries (trainer.objectives,
trainer.advantages), the fault hook from `run.faults`.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from dllm.replay import Rows, build_rows
from rollout_client.client import RolloutError
from trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    filter_zero_variance_groups,
    group_advantages,
    register_advantage,
    trace_gae,
)
from trainer.dist import RankError
from trainer.learner import baseline_rows
from trainer.objectives import OBJECTIVES
from trainer.replay import completion_rows
from trainer.rewards import score_batch

log = logging.getLogger("dlrl.train")


class StopRequested(BaseException):
    """SIGTERM / SIGINT: finish at the next step boundary (checkpoint, stop servers, exit 0).

    A BaseException, like KeyboardInterrupt: the signal handler raises it inside a push in flight,
    and no `except Exception` on the way (the sender's error wrapping, retries) may turn it into a
    push failure."""


class Timer(dict):
    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self[f"time_{name}"] = self.get(f"time_{name}", 0.0) + time.perf_counter() - t0


def sequence_advantages(cfg, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (advantage per sample [N], keep mask [N], number of groups filtered)."""
    adv = group_advantages(rewards, cfg.group_size)
    keep = torch.ones_like(rewards, dtype=torch.bool)
    num_filtered = 0
    if cfg.filter_zero_variance and rewards.numel():
        keep, frac = filter_zero_variance_groups(rewards, cfg.group_size)
        num_filtered = round(frac * rewards.numel() / cfg.group_size)
    return adv, keep, num_filtered


def row_minibatches(run, rows: Rows, sample_ids: torch.Tensor, num_samples: int, step: int) -> torch.Tensor:
    """Mini-batch of every row [R], from its sample's GLOBAL index: the same split on any
    number of ranks (sample g goes to mini-batch position(g) % updates_per_step)."""
    gen = torch.Generator().manual_seed(run.cfg.seed * 1_000_003 + step)
    position = torch.empty(num_samples, dtype=torch.long)
    position[torch.randperm(num_samples, generator=gen)] = torch.arange(num_samples)
    return position[sample_ids[rows.row_sample]] % run.cfg.updates_per_step


def token_advantages(run, rows, samples, rewards, seq_adv, row_mb) -> tuple[torch.Tensor, dict]:
    """Advantages at every row target [R, L], from the run's estimator (trainer.advantages registry)."""
    estimator = ADVANTAGE_ESTIMATORS[advantage_estimator(run.cfg)]
    return estimator(run, rows, samples, rewards, seq_adv, row_mb, _sequence_weights(run, rows, samples))


@register_advantage("group")
def _group_advantages(run, rows, samples, rewards, seq_adv, row_mb, weights) -> tuple[torch.Tensor, dict]:
    """Each sample's group z-score on every one of its tokens."""
    per_sample = [torch.full((len(s.completion_ids),), float(seq_adv[i])) for i, s in enumerate(samples)]
    return rows.gather(per_sample) * weights, {}


@register_advantage("gae")
def _value_gae(run, rows, samples, rewards, seq_adv, row_mb, weights) -> tuple[torch.Tensor, dict]:
    """TraceRL's value model: step-wise GAE on the trace's global step ids (shrunk like the replay
    rows); also trains the value model."""
    cfg = run.cfg
    values = run.learner.values(rows)  # [R, L]: V_j at the state that committed token j
    N, L = len(samples), max((len(s.completion_ids) for s in samples), default=0)
    tok_v = torch.zeros(N, L)
    r, c = rows.target.nonzero(as_tuple=True)
    tok_v[rows.sample_idx[r, c], rows.token_idx[r, c]] = values[r, c]
    returns, adv = trace_gae([s.trace for s in samples], tok_v, rewards, cfg.shrink, cfg.gamma, cfg.lam)
    row_adv = rows.gather([adv[i].float() for i in range(N)]) * weights
    row_ret = rows.gather([returns[i].float() for i in range(N)])
    return row_adv, run.learner.update_value(rows, values, row_ret, row_mb)


def _sequence_weights(run, rows, samples) -> torch.Tensor | float:
    """norm=sequence: weight each sample's tokens by mean_len / len (mean over ALL ranks' kept
    samples), so every sequence counts equally under the token-normalised loss (the PPO
    surrogate is positively homogeneous in the advantage)."""
    if run.cfg.norm != "sequence":
        return 1.0
    lens = torch.tensor([max(1, len(s.completion_ids)) for s in samples], dtype=torch.float32)
    total, count = run.ranks.sum([float(lens.sum()), float(len(lens))])
    scale = (total / max(count, 1.0)) / lens  # [N]
    return torch.where(rows.target, scale[rows.sample_idx.clamp(min=0)], torch.zeros(()))


def score(run, batch) -> torch.Tensor:
    examples = batch.group_examples(run.cfg.group_size)
    texts = [r.text for r in batch.rollouts]
    lengths = [len(r.completion_ids) for r in batch.rollouts]
    return torch.tensor(score_batch(run.reward_fn, texts, examples, num_tokens=lengths), dtype=torch.float32)


def replay(run, samples, num_samples: int):
    """Training rows of the kept samples (trace states, or random masks for the baselines)."""
    if OBJECTIVES[run.cfg.objective].masks is not None:
        return baseline_rows(completion_rows(samples, run.block_size, run.pad_id), run.cfg.objective,
                             run.mask_id, run.generator, num_sequences=num_samples)
    return build_rows(samples, run.block_size, run.mask_id, run.pad_id, run.cfg.shrink), None


def rl_step(run, step: int) -> dict:
    """One RL step on every rank; returns its metrics (global)."""
    t = Timer()
    run.faults.set_step(step + 1)
    with t("rollout"), run.faults.during("rollout", delay_s=0.05):  # dies while the requests are in flight
        batch = collect(run)
    metrics = learn(run, batch, step, t)
    with t("sync"):
        if metrics["num_kept"]:  # weights changed: push them as version+1
            run.publisher.push()
    oldest = metrics.pop("rollout_version_min")
    return {"step": step + 1, "version": run.version, **metrics, **t, "rollout_version_min": oldest,
            "staleness": run.version - (1 if metrics["num_kept"] else 0) - oldest}


def collect(run, attempts: int = 3):
    """This rank's rollouts, with every server at the trainer's version first (sync mode). A
    server lost mid-request (down, restarting) is waited for and re-synced, then every rank
    draws the step's prompts again (one decision for all ranks keeps their samplers in step)."""
    error: Exception | None = None
    for _ in range(attempts):
        if run.cfg.mode == "sync" or error is not None:
            run.publisher.check_fleet()
        batch, error = None, None
        try:
            batch = run.rollouts.get(run.version)
        except RolloutError as e:
            if e.status not in (None, 502, 503, 504):
                raise
            error = e
        (failed,) = run.ranks.max([float(error is not None)])
        if not failed:
            return batch
        if run.ranks.is_main:
            log.warning("rollouts failed (%s): checking the servers, then drawing the prompts again",
                        error or "on another rank")
    raise RuntimeError(f"rollouts failed {attempts} times; last error: {error}")


def learn(run, batch, step: int, t: Timer | None = None) -> dict:
    """Rewards -> advantages -> replay -> update on this rank's batch (collective); returns
    the step's training and batch metrics, reduced over all ranks."""
    cfg, t = run.cfg, t if t is not None else Timer()
    with t("reward"):
        rewards = score(run, batch)
    seq_adv, keep, num_filtered = sequence_advantages(cfg, rewards)
    kept = keep.nonzero().squeeze(1)
    samples = [batch.rollouts[int(i)] for i in kept]
    (num_kept,) = run.ranks.sum([len(samples)])
    train_metrics: dict = {}
    num_rows = 0
    if num_kept:  # one decision for all ranks
        with t("replay"):
            rows, weights = replay(run, samples, int(num_kept))
            old_lp = rows.gather([s.logprobs for s in samples])
            row_mb = row_minibatches(run, rows, kept + batch.first_sample, batch.num_samples, step)
            num_rows = rows.noisy.shape[0]
        with t("train"):
            adv, vstats = token_advantages(run, rows, samples, rewards[kept], seq_adv[kept], row_mb)
            train_metrics = run.learner.update(rows, old_lp, adv, row_mb, weights) | vstats
    return {**train_metrics, **batch_metrics(run, batch, rewards, seq_adv, keep, num_filtered, num_rows),
            "num_kept": int(num_kept)}


def batch_metrics(run, batch, rewards, seq_adv, keep, num_filtered, num_rows) -> dict:
    """Rollout / reward metrics over ALL ranks (sums and maxima all-reduced)."""
    rolls = batch.rollouts
    versions = [r.version for r in rolls]
    kept_adv = seq_adv[keep]
    sums = run.ranks.sum([
        len(rolls), float(rewards.sum()), float((rewards ** 2).sum()), float((rewards >= 1.0).sum()),
        len(batch.examples), num_filtered, num_rows, len(kept_adv), float(kept_adv.sum()),
        float(kept_adv.abs().sum()), sum(len(r.completion_ids) for r in rolls),
        sum(len(r.completion_ids) + len(r.trace.tail_ids) for r in rolls), sum(r.trace.num_forwards for r in rolls)])
    n, r_sum, r_sq, n_acc, n_groups, n_filt, n_rows, n_kept, a_sum, a_abs, n_tok, n_gen, n_fwd = sums
    oldest = -run.ranks.max([-min(versions, default=run.version)])[0]
    var = (r_sq - r_sum ** 2 / n) / (n - 1) if n > 1 else 0.0
    return {"reward_mean": r_sum / max(n, 1), "reward_std": max(var, 0.0) ** 0.5, "accuracy": n_acc / max(n, 1),
            "frac_filtered_groups": n_filt / max(n_groups, 1), "num_rows": int(n_rows),
            "adv_mean": a_sum / n_kept if n_kept else 0.0, "adv_abs_mean": a_abs / n_kept if n_kept else 0.0,
            "response_length": n_tok / max(n, 1), "tokens_per_forward": n_gen / max(n_fwd, 1),
            "rollout_version_min": int(oldest), "num_samples": int(n)}


def train_loop(run, should_stop=lambda: False) -> dict:
    """Run steps from run.start_step to cfg.num_steps; returns the last metrics. `should_stop()`
    (a signal arrived on some rank) is agreed on by all ranks at every step boundary."""
    cfg = run.cfg
    metrics: dict = {}
    for step in range(run.start_step, cfg.num_steps):
        try:
            metrics = rl_step(run, step)
        except (StopRequested, RankError) as e:  # a signal aborted the push in flight
            if isinstance(e, RankError) and e.kind != StopRequested.__name__:
                raise
            run.checkpoint(step + 1)  # the update is kept; the resumed run pushes it
            raise StopRequested(f"stopped by a signal during step {step + 1}") from None
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.num_steps):
            t0 = time.perf_counter()
            metrics |= run.evaluate() or {}
            metrics["time_eval"] = time.perf_counter() - t0
        metrics["time_step"] = sum(v for k, v in metrics.items() if k.startswith("time_") and k != "time_step")
        (stop,) = run.ranks.max([float(should_stop())])
        if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or (stop and step + 1 < cfg.num_steps):
            run.checkpoint(step + 1, metrics)
        run.log(step + 1, metrics)
        if stop and step + 1 < cfg.num_steps:
            raise StopRequested(f"stopped by a signal after step {step + 1}")
    return metrics
