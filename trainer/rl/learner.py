"""Learner: turns replayed rows into DeepSpeed updates of the policy (and the value model),
data-parallel over the job's ranks.

    learner = Learner(cfg, ranks, policy_engine, mask_id, ref=ref_module, value=value_engine)
    metrics = learner.update(rows, old_lp, adv, row_minibatch)     # one RL step's update
    values = learner.values(rows); vmetrics = learner.update_value(rows, values, returns, row_minibatch)

Each rank holds the rows of its own samples. Row r belongs to mini-batch `row_minibatch[r]`
(chosen from the GLOBAL sample index, so the split does not depend on the number of ranks);
each mini-batch is one optimizer step made of exactly `grad_accum` micro-batches per rank
(DeepSpeed's fixed gradient accumulation). The loss is token-normalised over the whole
mini-batch across ALL ranks (the token count is all-reduced) and scaled so that DeepSpeed's
gradient average over ranks gives the sum over every rank's tokens: an N-rank step makes the
same update as one rank with the same global batch. Every rank runs every micro-batch
forward, with a dummy row when it has none (ZeRO-3 gathers parameters collectively).
Metrics are token-weighted means over all ranks (`*_max`: the maximum).

Policy objectives (TraceRL, DiPO) score replayed trace steps against the behaviour logprobs
recorded by the server (full-attention models, LLaDA / Dream: one bidirectional row per trace step,
dllm.full.replay, behaviour log-probs still the sampler's); the baselines (random-masking, coupled) score the completion under
fresh random masks (see `baseline_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from dllm.full.replay import full_replay_hidden
from dllm.replay import Rows, replay_hidden
from trainer.infra.dist import Ranks
from trainer.infra.ds_engine import EngineOrModule, unwrap
from trainer.infra.faults import Faults
from trainer.rl.correction import is_weights, mismatch_stats
from trainer.rl.objectives import OBJECTIVES, value_loss
from trainer.rl.replay import chunked_token_logprobs

if TYPE_CHECKING:
    from torch import nn

    from trainer.config import TrainConfig
    from trainer.infra.ds_engine import DSEngine, Policy
    from trainer.rl.objectives import Metrics
    from trainer.rl.value_model import ValueModel


def is_full_attention(model: EngineOrModule) -> bool:
    """A full-attention model (LLaDA / Dream, dllm.full): its rows are one canvas per trace step, its replay
    forward bidirectional (dllm.full.replay); SDAR's are block-causal with a clean copy (dllm.replay)."""
    return getattr(unwrap(model), "attention", "block_causal") == "full"


def _policy_loss(cfg: TrainConfig, new_lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 ref_lp: torch.Tensor | None, entropy: torch.Tensor | None,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """The loss of `cfg.objective` from the registry (trainer.rl.objectives.OBJECTIVES). The
    random-masking / coupled baselines are on-policy (ratio 1) with their 1/t ELBO weights and
    per-sequence normalisation folded into the advantages by `baseline_rows`, which gives the
    same gradient as the masked-diffusion baseline losses but lets them share the mini-batch
    token normalisation of `update`. `weights`: importance corrections."""
    return OBJECTIVES[cfg.objective].loss(cfg, new_lp, old_lp, adv, mask, ref_lp, entropy, weights)


def baseline_rows(rows_like: Rows, objective: str, mask_id: int, generator: torch.Generator,
                  num_sequences: int | None = None) -> tuple[Rows, torch.Tensor]:
    """For random-masking / coupled RL: one row (two for coupled) per sample with a random mask
    over its completion tokens (instead of trace states). Returns rows and 1/t weights [R, L],
    which average over `num_sequences` (default: this batch's; give the global count)."""
    is_comp = rows_like.target
    spec = OBJECTIVES[objective]
    if spec.masks is None:
        raise ValueError(f"train.objective: {objective!r} trains on trace rows, it has no random-mask rows")
    masks, ts = spec.masks(is_comp, generator)
    num_seq = is_comp.shape[0] if num_sequences is None else num_sequences
    out, weights = [], []
    for m, tt in zip(masks, ts):
        noisy = torch.where(m, torch.full_like(rows_like.clean, mask_id), rows_like.clean)
        out.append(Rows(noisy, rows_like.clean, rows_like.pos, rows_like.valid, m, rows_like.sample_idx,
                        rows_like.token_idx, rows_like.row_sample, rows_like.bias))
        per_seq = len(masks) * is_comp.sum(1).clamp(min=1)[:, None] * num_seq  # mean over sequences
        weights.append(m.float() / tt.clamp(1e-6)[:, None] / per_seq)
    fields: dict[str, Any] = {f: None if v is None else torch.cat([getattr(r, f) for r in out])
                              for f, v in vars(out[0]).items()}  # Rows.bias may be None
    cat = Rows(**fields)
    return cat, torch.cat(weights)


def _select(rows: Rows, idx: torch.Tensor) -> Rows:
    fields: dict[str, Any] = {f: None if v is None else v[idx] for f, v in vars(rows).items()}  # Rows.bias: None
    return Rows(**fields)


def _dummy_rows(like: Rows) -> Rows:
    """One padding row with no target: a forward that contributes nothing (ZeRO-3 needs it)."""
    L = like.noisy.shape[1]
    zeros = torch.zeros(1, L, dtype=torch.long)
    valid = torch.zeros(1, L, dtype=torch.bool)
    valid[0, 0] = True
    return Rows(zeros, zeros, torch.arange(L)[None], valid, torch.zeros(1, L, dtype=torch.bool),
                zeros - 1, zeros - 1, torch.zeros(1, dtype=torch.long),
                None if like.bias is None else torch.zeros(1, *like.bias.shape[1:], dtype=like.bias.dtype))


class MetricSums:
    """Token-weighted metric sums of one rank; `reduce` combines all ranks."""

    def __init__(self) -> None:
        self.parts: list[tuple[dict[str, float], float]] = []

    def add(self, metrics: dict[str, float], weight: float) -> None:
        if metrics and weight > 0:
            self.parts.append((metrics, float(weight)))

    def reduce(self, ranks: Ranks) -> dict[str, float]:
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        maxes: dict[str, float] = {}
        for parts in ranks.all_gather(self.parts):
            for metrics, w in parts:
                for k, v in metrics.items():
                    if k.endswith("_max"):
                        maxes[k] = max(maxes.get(k, v), v)
                    else:
                        sums[k] = sums.get(k, 0.0) + v * w
                        weights[k] = weights.get(k, 0.0) + w
        return {**{k: sums[k] / weights[k] for k in sums}, **maxes}


MicroFn = Callable[[Rows, torch.Tensor, float, int], tuple[torch.Tensor, dict[str, float]]]


class Learner:
    def __init__(self, cfg: TrainConfig, ranks: Ranks, engine: DSEngine[Policy], mask_id: int, ref: Policy | None = None,
                 value: DSEngine[ValueModel] | None = None, faults: Faults | None = None) -> None:
        self.cfg, self.ranks, self.engine, self.mask_id = cfg, ranks, engine, mask_id
        self.ref_model, self.value = ref, value
        self.faults = faults or Faults()  # the run's fault hook (DLRL_FAULT=optimizer:N)

    @property
    def device(self) -> torch.device:
        return next(self.engine.module.parameters()).device

    def _logprobs(self, model: DSEngine[Policy] | Policy, rows: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (log-probs [R, L], entropy [R, L], anchor) of rows.target under `model` (the policy's
        DeepSpeed engine, whose forward keeps ZeRO-3 gradient accumulation right, or the frozen
        reference). Full-vocabulary logits only for `logprob_chunk` scored tokens at a time."""
        dev, cfg = self.device, self.cfg
        module = unwrap(model)
        forward = full_replay_hidden if is_full_attention(module) else replay_hidden
        hidden = forward(model, rows, dev)  # [R, L, D]
        target = rows.target.to(dev)
        n = int(target.sum())
        step = cfg.logprob_chunk if cfg.logprob_chunk > 0 else max(n, 1)
        (num_chunks,) = self.ranks.max([-(-n // step)])  # every rank calls lm_head equally often (ZeRO-3)
        lp_t, ent_t, anchor = chunked_token_logprobs(
            module.lm_head, hidden[target], rows.clean.to(dev)[target], self.mask_id, cfg.temperature,
            chunk=step, num_chunks=int(num_chunks), filler=hidden.reshape(-1, hidden.shape[-1])[:1],
            bias=rows.token_bias(target))
        zeros = torch.zeros(target.shape, dtype=torch.float32, device=dev)
        return zeros.masked_scatter(target, lp_t), zeros.masked_scatter(target, ent_t), anchor

    # ------------------------------------------------------------------ the shared loop
    def _partitions(self, rows: Rows, row_mb: torch.Tensor) -> Iterator[tuple[int, float, torch.Tensor]]:
        """(mini-batch k, global token count, micro-batch row indices) in the order every rank
        runs them; empty micro-batches are kept (they run a dummy row)."""
        gas = self.engine.gradient_accumulation_steps()
        for k in range(self.cfg.updates_per_step):
            idx = (row_mb == k).nonzero().squeeze(1)
            (n_tok,) = self.ranks.sum([float(rows.target[idx].sum())])
            if n_tok == 0:  # the same decision on every rank
                continue
            for part in torch.tensor_split(idx, gas):
                yield k, n_tok, part

    def _minibatches(self, engine: DSEngine[nn.Module], rows: Rows, row_mb: torch.Tensor, micro: MicroFn) -> dict[str, float]:
        """One optimizer step of `engine` per mini-batch, `grad_accum` micro-batches each, every
        micro loss normalised by the mini-batch's global token count."""
        sums = MetricSums()
        gas, world = engine.gradient_accumulation_steps(), self.ranks.world_size
        for k, n_tok, part in self._partitions(rows, row_mb):
            sub = _select(rows, part) if len(part) else _dummy_rows(rows)
            loss, metrics = micro(sub, part, n_tok, k)
            engine.backward(loss * gas * world)  # DeepSpeed divides by gas and averages over ranks
            self.faults.crash_at("optimizer")
            engine.step()
            sums.add(metrics, float(sub.target.sum()))
        return sums.reduce(self.ranks)

    # ------------------------------------------------------------------ policy
    @torch.no_grad()
    def recompute(self, rows: Rows, row_mb: torch.Tensor) -> torch.Tensor:
        """The policy's log-probs of every target [R, L] with the weights before the update,
        computed in the update's own micro-batches (so ZeRO-3 ranks stay in step)."""
        out = torch.zeros(rows.target.shape, dtype=torch.float32)
        for _, _, part in self._partitions(rows, row_mb):
            sub = _select(rows, part) if len(part) else _dummy_rows(rows)
            lp, _, _ = self._logprobs(self.engine, sub)
            if len(part):
                out[part] = lp.float().cpu()
        return out

    def update(self, rows: Rows, behaviour_lp: torch.Tensor, adv: torch.Tensor, row_mb: torch.Tensor,
               weights: torch.Tensor | None = None) -> dict[str, float]:
        """rows [R, L] of this rank; behaviour_lp/adv/weights [R, L] at rows.target; row_mb [R]."""
        cfg = self.cfg
        old_lp, is_w, extra = behaviour_lp, None, MetricSums()
        if cfg.is_correction != "none" and weights is None:
            old_lp = self.recompute(rows, row_mb)  # PPO ratio against the trainer's own old log-probs
            is_w, stats = is_weights(old_lp - behaviour_lp, rows.target, rows.sample_idx, cfg.is_correction,
                                     cfg.is_level, cfg.is_cap)
            extra.add({**stats, **mismatch_stats(old_lp, behaviour_lp, rows.target)}, float(rows.target.sum()))

        def micro(sub: Rows, part: torch.Tensor, n_tok: float, k: int) -> tuple[torch.Tensor, Metrics]:
            before_update = k == 0 and is_w is None and weights is None  # mini-batch 0: still the old weights
            return self._micro_loss(sub, old_lp[part], adv[part], None if weights is None else weights[part],
                                    None if is_w is None else is_w[part], n_tok,
                                    behaviour=behaviour_lp[part] if before_update else None)

        metrics = self._minibatches(self.engine, rows, row_mb, micro)
        return metrics | extra.reduce(self.ranks)

    def _micro_loss(self, rows: Rows, old_lp: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor | None,
                    is_w: torch.Tensor | None, n_tok: float,
                    behaviour: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
        """behaviour: the server's log-probs, given while the weights are still those that served
        them (then the train-serve mismatch is reported)."""
        cfg, dev = self.cfg, self.device
        mask = rows.target.to(dev)
        lp, ent, anchor = self._logprobs(self.engine, rows)
        ref_lp = None
        if self.ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref_lp, _, _ = self._logprobs(self.ref_model, rows)
        if len(old_lp) == 0:  # dummy row
            old_lp, adv = torch.zeros_like(lp), torch.zeros_like(lp)
        adv, old_lp = adv.to(dev), old_lp.to(dev)
        if weights is not None and len(weights):  # baselines: 1/t ELBO weights, on-policy ratio
            old_lp = lp.detach()
            adv = adv * weights.to(dev) * n_tok
        iw = is_w.to(dev) if is_w is not None and len(is_w) else None
        loss, metrics = _policy_loss(cfg, lp, old_lp, adv, mask, ref_lp, ent, iw)
        if behaviour is not None and len(behaviour):
            metrics |= mismatch_stats(lp, behaviour.to(dev), mask)
        return loss * (mask.sum() / n_tok) + anchor, metrics  # token-normalise over the global mini-batch

    # ------------------------------------------------------------------ value model
    def _value(self) -> DSEngine[ValueModel]:
        if self.value is None:
            raise RuntimeError("no value model: train.use_value_model is false")
        return self.value

    def values(self, rows: Rows) -> torch.Tensor:
        """Value-model estimates at every row position [R, L] (no grad)."""
        value = self._value()
        dev = value.device
        sub = rows if rows.noisy.shape[0] else _dummy_rows(rows)
        with torch.no_grad():
            v = value(sub.noisy.to(dev), sub.clean.to(dev), sub.pos.to(dev), sub.valid.to(dev)).float().cpu()
        return v[:rows.noisy.shape[0]]

    def update_value(self, rows: Rows, old_values: torch.Tensor, returns: torch.Tensor,
                     row_mb: torch.Tensor) -> dict[str, float]:
        value = self._value()
        dev = value.device
        moments = torch.zeros(5, dtype=torch.float64)  # n, sum R, sum R^2, sum e, sum e^2 (e = R - V)

        def micro(sub: Rows, part: torch.Tensor, n_tok: float, k: int) -> tuple[torch.Tensor, Metrics]:
            v = value(sub.noisy.to(dev), sub.clean.to(dev), sub.pos.to(dev), sub.valid.to(dev))
            old = old_values[part].to(dev) if len(part) else torch.zeros_like(v)
            ret = returns[part].to(dev) if len(part) else torch.zeros_like(v)
            mask = sub.target.to(dev)
            loss, metrics = value_loss(v, old, ret, mask, clip=self.cfg.value_clip)
            r, e = ret[mask].double().cpu(), (ret - v.detach())[mask].double().cpu()
            moments.add_(torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(),
                                      (r * r).sum(), e.sum(), (e * e).sum()]))
            metrics.pop("explained_var", None)  # a global statistic, computed below
            return loss * (mask.sum() / n_tok), metrics

        metrics = self._minibatches(value, rows, row_mb, micro)
        n, r1, r2, e1, e2 = self.ranks.sum(moments.tolist())
        var_r, var_e = (r2 / n - (r1 / n) ** 2, e2 / n - (e1 / n) ** 2) if n else (0.0, 0.0)
        return {**metrics, "explained_var": 1 - var_e / var_r if var_r > 0 else 0.0}
