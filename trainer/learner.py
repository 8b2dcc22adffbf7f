"""Learner: turns replayed rows into DeepSpeed updates of the policy (and the value model).

One `update` per RL step: rows are split into `updates_per_step` mini-batches; each is
one optimizer step made of exactly `grad_accum` micro-batches (DeepSpeed's fixed
gradient accumulation), with the
loss normalised over the whole mini-batch (token-level), so the result does not depend
on how rows are split.

Policy objectives (TraceRL, DiPO) score replayed trace steps against the behaviour
logprobs recorded by the server; the baselines (random-masking, coupled) score the
completion under fresh random masks (see `baseline_rows`).
"""

from __future__ import annotations

import math

import torch

from trainer.objectives import complementary_masks, get_objective, random_mask, value_loss
from trainer.replay import Rows, token_entropy, token_logprobs


def _policy_loss(cfg, new_lp, old_lp, adv, mask, ref_lp, entropy):
    """TraceRL's symmetric clip, or DiPO's asymmetric one. The random-masking / coupled
    baselines also come here: on-policy (ratio 1) with their 1/t ELBO weights and
    per-sequence normalisation folded into the advantages by `baseline_rows`, which gives
    the same gradient as `objectives.random_masking_loss` / `coupled_loss` but lets them
    share the mini-batch token normalisation of `update`."""
    name = cfg.objective
    fn = get_objective(name)
    if name == "tracerl":
        return fn(new_lp, old_lp, adv, mask, eps_clip=cfg.eps_clip, ref_logprobs=ref_lp, kl_coef=cfg.kl_coef,
                  log_ratio_clip=cfg.log_ratio_clip, norm="token", entropy=entropy)
    return get_objective("dipo")(new_lp, old_lp, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                 ref_logprobs=ref_lp, kl_coef=cfg.kl_coef, log_ratio_clip=cfg.log_ratio_clip,
                                 entropy=entropy)


def baseline_rows(rows_like: Rows, objective: str, mask_id: int,
                  generator: torch.Generator) -> tuple[Rows, torch.Tensor]:
    """For random-masking / coupled RL: one row (two for coupled) per sample with a random mask
    over its completion tokens (instead of trace states). Returns rows and 1/t weights [R, L]."""
    is_comp = rows_like.target
    if objective == "random_masking":
        mask, t = random_mask(is_comp, generator)
        masks, ts = [mask], [t]
    else:
        mask, comp, t = complementary_masks(is_comp, generator)
        masks, ts = [mask, comp], [t, 1 - t]
    out, weights = [], []
    for m, tt in zip(masks, ts):
        noisy = torch.where(m, torch.full_like(rows_like.clean, mask_id), rows_like.clean)
        out.append(Rows(noisy, rows_like.clean, rows_like.pos, rows_like.valid, m, rows_like.sample_idx,
                        rows_like.token_idx, rows_like.row_sample))
        per_seq = len(masks) * is_comp.sum(1).clamp(min=1)[:, None] * is_comp.shape[0]  # mean over sequences
        weights.append(m.float() / tt.clamp(1e-6)[:, None] / per_seq)
    cat = Rows(*(torch.cat([getattr(r, f) for r in out]) for f in Rows.__dataclass_fields__))
    return cat, torch.cat(weights)


class Learner:
    def __init__(self, cfg, engine, mask_id: int, ref_model=None, value=None):
        self.cfg, self.engine, self.mask_id = cfg, engine, mask_id
        self.ref_model, self.value = ref_model, value

    @property
    def device(self):
        return next(self.engine.module.parameters()).device

    def _forward_lp(self, model, rows: Rows, temperature: float):
        dev = self.device
        logits = model.forward_train(rows.noisy.to(dev), rows.clean.to(dev), rows.pos.to(dev), rows.valid.to(dev))
        lp = token_logprobs(logits, rows.clean.to(dev), self.mask_id, temperature)
        return lp, logits

    def update(self, rows: Rows, old_lp: torch.Tensor, adv: torch.Tensor,
               weights: torch.Tensor | None = None) -> dict:
        """rows [R, L]; old_lp/adv/weights [R, L] at rows.target. Returns averaged metrics."""
        cfg = self.cfg
        R = rows.noisy.shape[0]
        order = torch.randperm(R)
        minibatches = [order[i::cfg.updates_per_step] for i in range(cfg.updates_per_step)]
        totals: dict[str, float] = {}
        count = 0
        for mb in minibatches:
            if len(mb) == 0:
                continue
            n_tok = rows.target[mb].sum().clamp(min=1)
            gas = self.engine.gradient_accumulation_steps()
            for idx in torch.tensor_split(mb, gas):  # DeepSpeed steps after exactly `gas` backwards
                sub = Rows(*(getattr(rows, f)[idx] for f in Rows.__dataclass_fields__))
                loss, metrics = self._micro_loss(sub, old_lp[idx], adv[idx],
                                                 None if weights is None else weights[idx], n_tok)
                self.engine.backward(loss * gas)
                self.engine.step()
                for key, val in metrics.items():
                    totals[key] = totals.get(key, 0.0) + val
                count += bool(metrics)
        return {k: v / max(1, count) for k, v in totals.items()}

    def _micro_loss(self, rows: Rows, old_lp, adv, weights, n_tok):
        cfg = self.cfg
        dev = self.device
        mask = rows.target.to(dev)
        if mask.numel() == 0 or not mask.any():
            p = next(self.engine.module.parameters())
            return p.sum() * 0.0, {}
        lp, logits = self._forward_lp(self.engine.module, rows, cfg.temperature)
        with torch.no_grad():
            ent = token_entropy(logits.detach(), self.mask_id)
            ref_lp = None
            if self.ref_model is not None and cfg.kl_coef > 0:
                ref_lp, _ = self._forward_lp(self.ref_model, rows, cfg.temperature)
        adv, old_lp = adv.to(dev), old_lp.to(dev)
        if weights is not None:  # baselines: 1/t ELBO weights, on-policy ratio
            old_lp = lp.detach()
            adv = adv * weights.to(dev) * n_tok
        loss, metrics = _policy_loss(cfg, lp, old_lp, adv, mask, ref_lp, ent)
        scale = mask.sum() / n_tok  # token-normalise over the whole mini-batch
        return loss * scale, metrics

    def values(self, rows: Rows) -> torch.Tensor:
        """Value-model estimates at every row position [R, L] (no grad)."""
        dev = self.value.device
        with torch.no_grad():
            return self.value(rows.noisy.to(dev), rows.clean.to(dev), rows.pos.to(dev),
                              rows.valid.to(dev)).float().cpu()

    def update_value(self, rows: Rows, old_values: torch.Tensor, returns: torch.Tensor) -> dict:
        dev = self.value.device
        metrics = {}
        step = max(1, math.ceil(rows.noisy.shape[0] / self.cfg.grad_accum))
        for i in range(0, rows.noisy.shape[0], step):
            sl = slice(i, i + step)
            v = self.value(rows.noisy[sl].to(dev), rows.clean[sl].to(dev), rows.pos[sl].to(dev),
                           rows.valid[sl].to(dev))
            loss, metrics = value_loss(v, old_values[sl].to(dev), returns[sl].to(dev),
                                       rows.target[sl].to(dev), clip=self.cfg.value_clip)
            self.value.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.value.parameters(), self.cfg.grad_clip)
            self.value.optimizer.step()
        return metrics

