"""The online RL loop (slime style: one short function per step), data-parallel over ranks.

    dlrl train --config configs/tiny.yaml [num_steps=20 objective=dipo nproc=2 ...]

Each step: servers checked -> this rank's prompts -> rollouts with traces -> rewards ->
advantages (group z-score, or value model + step-wise GAE) -> optional zero-variance group
filter -> trace replay into training rows -> loss -> DeepSpeed step (gradients averaged over
ranks, losses normalised by global token counts) -> push version+1 into every server in place
(rank 0; weight_sync) -> metrics reduced over ranks (rank 0 logs).

This module is what a run DOES (functions of a `trainer.run.Run`, which holds what it IS); the
objective and the advantage estimator come from their registries (trainer.rl.objectives,
trainer.rl.advantages), the fault hook from `run.faults`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from dllm.full.replay import build_full_rows
from dllm.replay import Rows, bucket_length, build_rows, pad_rows
from rollout_client.client import RolloutError
from trainer.infra.dist import RankError
from trainer.rewards import score_batch
from trainer.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    filter_zero_variance_groups,
    group_advantages,
    register_advantage,
    trace_gae,
)
from trainer.rl.learner import baseline_rows, is_full_attention
from trainer.rl.objectives import OBJECTIVES
from trainer.rl.replay import completion_rows
from trainer.rl.rollouts import Batch

if TYPE_CHECKING:
    from rollout_client.protocol.rollout import Rollout
    from trainer.config import TrainConfig
    from trainer.run import Run

log = logging.getLogger("dlrl.train")


class StopRequested(BaseException):
    """SIGTERM / SIGINT: finish at the next step boundary (checkpoint, stop servers, exit 0).

    A BaseException, like KeyboardInterrupt: the signal handler raises it inside a push in flight,
    and no `except Exception` on the way (the sender's error wrapping, retries) may turn it into a
    push failure."""


class Timer(dict):
    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self[f"time_{name}"] = self.get(f"time_{name}", 0.0) + time.perf_counter() - t0


def sequence_advantages(cfg: TrainConfig, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (advantage per sample [N], keep mask [N], number of groups filtered)."""
    adv = group_advantages(rewards, cfg.group_size)
    keep = torch.ones_like(rewards, dtype=torch.bool)
    num_filtered = 0
    if cfg.filter_zero_variance and rewards.numel():
        keep, frac = filter_zero_variance_groups(rewards, cfg.group_size)
        num_filtered = round(frac * rewards.numel() / cfg.group_size)
    return adv, keep, num_filtered


def row_minibatches(run: Run, rows: Rows, sample_ids: torch.Tensor, num_samples: int, step: int) -> torch.Tensor:
    """Mini-batch of every row [R], from its sample's GLOBAL index: the same split on any
    number of ranks (sample g goes to mini-batch position(g) % updates_per_step)."""
    gen = torch.Generator().manual_seed(run.cfg.seed * 1_000_003 + step)
    position = torch.empty(num_samples, dtype=torch.long)
    position[torch.randperm(num_samples, generator=gen)] = torch.arange(num_samples)
    return position[sample_ids[rows.row_sample]] % run.cfg.updates_per_step


def token_advantages(run: Run, rows: Rows, samples: list[Rollout], rewards: torch.Tensor, seq_adv: torch.Tensor,
                     row_mb: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Advantages at every row target [R, L], from the run's estimator (trainer.rl.advantages registry)."""
    estimator = ADVANTAGE_ESTIMATORS[advantage_estimator(run.cfg)]
    return estimator(run, rows, samples, rewards, seq_adv, row_mb, _sequence_weights(run, rows, samples))


@register_advantage("group")
def _group_advantages(run: Run, rows: Rows, samples: list[Rollout], rewards: torch.Tensor, seq_adv: torch.Tensor,
                      row_mb: torch.Tensor, weights: torch.Tensor | float) -> tuple[torch.Tensor, dict]:
    """Each sample's group z-score on every one of its tokens."""
    per_sample = [torch.full((len(s.completion_ids),), float(seq_adv[i])) for i, s in enumerate(samples)]
    return rows.gather(per_sample) * weights, {}


@register_advantage("gae")
def _value_gae(run: Run, rows: Rows, samples: list[Rollout], rewards: torch.Tensor, seq_adv: torch.Tensor,
               row_mb: torch.Tensor, weights: torch.Tensor | float) -> tuple[torch.Tensor, dict]:
    """TraceRL's value model: step-wise GAE on the trace's global step ids (shrunk like the replay
    rows); also trains the value model."""
    cfg = run.cfg
    values = run.learner.values(rows)  # [R, L]: V_j at the state that committed token j
    N, L = len(samples), max((len(s.completion_ids) for s in samples), default=0)
    tok_v = torch.zeros(N, L)
    r, c = rows.target.nonzero(as_tuple=True)
    tok_v[rows.sample_idx[r, c], rows.token_idx[r, c]] = values[r, c]
    traces = [s.trace for s in samples if s.trace is not None]
    if len(traces) != N:
        raise ValueError("trace: a sample without its decoding trace cannot be replayed (generate it with "
                         "return_trace=true)")
    returns, adv = trace_gae(traces, tok_v, rewards, cfg.shrink, cfg.gamma, cfg.lam)
    row_adv = rows.gather([adv[i].float() for i in range(N)]) * weights
    row_ret = rows.gather([returns[i].float() for i in range(N)])
    return row_adv, run.learner.update_value(rows, values, row_ret, row_mb)


def _sequence_weights(run: Run, rows: Rows, samples: list[Rollout]) -> torch.Tensor | float:
    """norm=sequence: weight each sample's tokens by mean_len / len (mean over ALL ranks' kept
    samples), so every sequence counts equally under the token-normalised loss (the PPO
    surrogate is positively homogeneous in the advantage)."""
    if run.cfg.norm != "sequence":
        return 1.0
    lens = torch.tensor([max(1, len(s.completion_ids)) for s in samples], dtype=torch.float32)
    total, count = run.ranks.sum([float(lens.sum()), float(len(lens))])
    scale = (total / max(count, 1.0)) / lens  # [N]
    return torch.where(rows.target, scale[rows.sample_idx.clamp(min=0)], torch.zeros(()))


def score(run: Run, batch: Batch) -> torch.Tensor:
    examples = batch.group_examples(run.cfg.group_size)
    texts = [r.text for r in batch.rollouts]
    lengths = [len(r.completion_ids) for r in batch.rollouts]
    return torch.tensor(score_batch(run.reward_fn, texts, examples, num_tokens=lengths), dtype=torch.float32)


def replay(run: Run, samples: list[Rollout], num_samples: int) -> tuple[Rows, torch.Tensor | None]:
    """Training rows of the kept samples (trace states, or random masks for the baselines). Full-attention
    models replay each trace step as one canvas (dllm.full.replay.build_full_rows: tokens of step >= s
    masked, step s scored, `shrink` merging steps); the baselines' random masks are the same for both."""
    if OBJECTIVES[run.cfg.objective].masks is not None:
        return baseline_rows(completion_rows(samples, run.block_size, run.pad_id), run.cfg.objective,
                             run.mask_id, run.generator, num_sequences=num_samples)
    if is_full_attention(run.learner.engine):  # LLaDA / Dream: mask step >= s, score step s, one row each
        return build_full_rows(samples, run.mask_id, run.pad_id, run.cfg.shrink), None
    rows = build_rows(samples, run.block_size, run.mask_id, run.pad_id, run.cfg.shrink)
    if run.cfg.length_buckets:  # a few shapes per run (compiled layers, flex kernels): padding scores nothing
        rows = pad_rows(rows, bucket_length(rows.clean.shape[1], run.block_size), run.pad_id)
    return rows, None


class LoopHooks:
    """What a loop built on `rl_step` / `train_loop` changes; the defaults are `dlrl train`'s
    (`dlrl align`'s controller is the other one: trainer.align.controller.Aligner).

    `learned` is set by `rl_step` once the step's update is applied (a stop during its push keeps it)."""

    learned: bool = False

    def collect(self, run: Run, step: int) -> Batch:
        """The step's batch (this rank's rollouts)."""
        return collect(run)

    def pushing(self, run: Run, step: int) -> None:
        """The step's update is about to be pushed as version+1."""

    def stepped(self, run: Run, step: int, batch: Batch, parent: int) -> dict[str, Any]:
        """After the step's push (`parent`: the version it trained from); extra step metrics."""
        return {}

    def done(self, run: Run, step: int) -> bool:
        """No step after `step` (the number of steps taken so far)."""
        return step >= run.cfg.num_steps

    def after(self, run: Run, step: int, metrics: dict[str, Any], should_stop: Callable[[], bool]) -> dict[str, Any]:
        """After step `step` (1-based), before its checkpoint and log line: the evaluation when due."""
        cfg = run.cfg
        if not (cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.num_steps)):
            return {}
        t0 = time.perf_counter()
        return {**(run.evaluate() or {}), "time_eval": time.perf_counter() - t0}

    def logged(self, run: Run, step: int, metrics: dict[str, Any]) -> None:
        """Step `step`'s line is in metrics.jsonl."""

    def stopping(self) -> None:
        """A signal stops the loop; its checkpoint comes next."""

    def extra(self) -> dict[str, Any] | None:
        """The loop's own state saved with every checkpoint (`run.resumed_extra` on resume)."""
        return None

    def finish(self, run: Run, step: int, metrics: dict[str, Any], should_stop: Callable[[], bool]) -> dict[str, Any]:
        """After the last step: the loop's result."""
        return metrics


def rl_step(run: Run, step: int, hooks: LoopHooks | None = None) -> dict[str, Any]:
    """One RL step on every rank; returns its metrics (global)."""
    hooks = hooks if hooks is not None else LoopHooks()
    t = Timer()
    hooks.learned = False
    run.faults.set_step(step + 1)
    with t("rollout"), run.faults.during("rollout", delay_s=0.05):  # dies while the requests are in flight
        batch = hooks.collect(run, step)
    parent = run.version
    metrics = learn(run, batch, step, t)
    hooks.learned = True
    with t("sync"):
        if metrics["num_kept"]:  # weights changed: push them as version+1
            hooks.pushing(run, step)
            run.publisher.push()
    oldest = metrics.pop("rollout_version_min")
    return {"step": step + 1, "version": run.version, **metrics, **t, "rollout_version_min": oldest,
            "staleness": run.version - (1 if metrics["num_kept"] else 0) - oldest,
            **hooks.stepped(run, step, batch, parent)}


def collect(run: Run, attempts: int = 3) -> Batch:
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
        if not failed and batch is not None:
            return batch
        if run.ranks.is_main:
            log.warning("rollouts failed (%s): checking the servers, then drawing the prompts again",
                        error or "on another rank")
    raise RuntimeError(f"rollouts failed {attempts} times; last error: {error}")


def trace_free_problem(cfg: TrainConfig, rollouts: list[Rollout]) -> str | None:
    """Why these rollouts cannot train `cfg` (None: they can): a trace-free rollout (Trace.trace_free,
    e.g. from server.backend=lmdeploy) has no denoising steps or behaviour log-probabilities, which
    trace replay, the value model's step-wise GAE and the IS corrections need."""
    free = next((r.trace for r in rollouts if r.trace is not None and r.trace.trace_free), None)
    if free is None:
        return None
    needs = ([f"train.objective={cfg.objective}"] if OBJECTIVES[cfg.objective].masks is None else []) + \
        (["train.use_value_model=true"] if cfg.use_value_model else [])
    if not needs:
        return None
    working = ", ".join(n for n, spec in OBJECTIVES.items() if spec.masks is not None)
    return (f"{' and '.join(needs)} needs decoding traces, but the rollouts of server backend "
            f"{free.backend or 'native'!r} are trace-free (no denoising steps or behaviour log-probabilities); "
            f"train from them with train.objective in ({working}) and train.use_value_model=false, "
            "or serve with server.backend=native (exact traces)")


def learn(run: Run, batch: Batch, step: int, t: Timer | None = None) -> dict[str, Any]:
    """Rewards -> advantages -> replay -> update on this rank's batch (collective); returns
    the step's training and batch metrics, reduced over all ranks."""
    cfg, t = run.cfg, t if t is not None else Timer()
    problem = trace_free_problem(cfg, batch.rollouts)
    if run.ranks.max([float(problem is not None)])[0]:  # one decision for all ranks
        raise ValueError(problem or "trace-free rollouts on another rank (see its log)")
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


def batch_metrics(run: Run, batch: Batch, rewards: torch.Tensor, seq_adv: torch.Tensor, keep: torch.Tensor,
                  num_filtered: int, num_rows: int) -> dict[str, Any]:
    """Rollout / reward metrics over ALL ranks (sums and maxima all-reduced)."""
    rolls = batch.rollouts
    versions = [r.version for r in rolls]
    kept_adv = seq_adv[keep]
    traces = [r.trace for r in rolls if r.trace is not None]  # every rollout of the loop has its trace
    if len(traces) != len(rolls):
        raise ValueError("trace: a rollout came without its decoding trace")
    sums = run.ranks.sum([
        len(rolls), float(rewards.sum()), float((rewards ** 2).sum()), float((rewards >= 1.0).sum()),
        len(batch.examples), num_filtered, num_rows, len(kept_adv), float(kept_adv.sum()),
        float(kept_adv.abs().sum()), sum(len(r.completion_ids) for r in rolls),
        sum(len(r.completion_ids) + len(tr.tail_ids) for r, tr in zip(rolls, traces)),
        sum(tr.num_forwards for tr in traces)])
    n, r_sum, r_sq, n_acc, n_groups, n_filt, n_rows, n_kept, a_sum, a_abs, n_tok, n_gen, n_fwd = sums
    oldest = -run.ranks.max([-min(versions, default=run.version)])[0]
    var = (r_sq - r_sum ** 2 / n) / (n - 1) if n > 1 else 0.0
    return {"reward_mean": r_sum / max(n, 1), "reward_std": max(var, 0.0) ** 0.5, "accuracy": n_acc / max(n, 1),
            "frac_filtered_groups": n_filt / max(n_groups, 1), "num_rows": int(n_rows),
            "adv_mean": a_sum / n_kept if n_kept else 0.0, "adv_abs_mean": a_abs / n_kept if n_kept else 0.0,
            "response_length": n_tok / max(n, 1), "tokens_per_forward": n_gen / max(n_fwd, 1),
            "rollout_version_min": int(oldest), "num_samples": int(n)}


def train_loop(run: Run, should_stop: Callable[[], bool] = lambda: False,
               hooks: LoopHooks | None = None) -> dict[str, Any]:
    """Steps from run.start_step until `hooks.done` (cfg.num_steps by default); returns the last
    metrics. `should_stop()` (a signal arrived on some rank) is agreed on by all ranks at every
    step boundary: the loop checkpoints and raises StopRequested."""
    hooks = hooks if hooks is not None else LoopHooks()
    step, metrics = run.start_step, {}
    while not hooks.done(run, step):
        try:
            metrics = rl_step(run, step, hooks)
        except (StopRequested, RankError) as e:  # a signal aborted the push in flight
            if isinstance(e, RankError) and e.kind != StopRequested.__name__:
                raise
            hooks.stopping()
            run.checkpoint(step + 1 if hooks.learned else step, extra=hooks.extra())  # the update is kept
            raise StopRequested(f"stopped by a signal during step {step + 1}") from None
        step += 1
        metrics |= hooks.after(run, step, metrics, should_stop)
        metrics["time_step"] = sum(v for k, v in metrics.items() if k.startswith("time_") and k != "time_step")
        (stop,) = run.ranks.max([float(should_stop())])
        run.log(step, metrics)
        hooks.logged(run, step, metrics)
        last = hooks.done(run, step)
        if stop and not last:
            hooks.stopping()
        if (run.cfg.checkpoint_every and step % run.cfg.checkpoint_every == 0) or (stop and not last):
            run.checkpoint(step, metrics, extra=hooks.extra())
        if stop and not last:
            raise StopRequested(f"stopped by a signal after step {step}")
    return hooks.finish(run, step, metrics, should_stop)
