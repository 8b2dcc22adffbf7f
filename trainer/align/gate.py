"""The promotion gate of `dlrl align`: a candidate reaches users only if it passes all three checks.

    gate = Gate(align_cfg, train_cfg, held_out_examples, reward_fn, prompt_ids_of, mask_id, block_size, pad_id)
    serving = gate.scores(serving_fleet.generate)                  # once per serving version (cached)
    cand = gate.scores(rollout_fleet.generate) | gate.kl(rollout_fleet.generate, policy, reference)
    result = gate.check(cand, serving)       # GateResult(passed, reasons, candidate, serving)

1. **No regression**: greedy held-out accuracy by `trainer.evaluation.evaluate.evaluate` (the code behind
   `dlrl eval`) is at least the serving version's minus `align.tolerance`.
2. **KL budget**: the candidate (the trainer's policy, pushed to the rollout servers) samples
   `align.kl_prompts` held-out prompts; trace replay rebuilds every denoising state and scores the
   sampled tokens under the candidate and under a frozen copy of the serving version's weights
   (kept in the trainer, as DiPO's KL reference). The mean per-token k3 estimate
   exp(ref - cand) - (ref - cand) - 1 of KL(candidate || serving) must be <= `align.kl_budget`.
3. **Sanity monitors** (the cheap signs of reward hacking) on the held-out answers: mean length
   within a factor `max_length_ratio` of the serving version's, stop rate not down by more than
   `max_stop_rate_drop`, empty answers <= `max_empty_frac`, degenerate answers (one short unit
   repeated, e.g. "aaaa", "1212121212", "the the the the") <= `max_degenerate_frac`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dllm.full.replay import build_full_rows, full_replay_hidden
from dllm.replay import Rows, build_rows
from trainer.evaluation.evaluate import DecodingSetting, SettingResult, evaluate
from trainer.rl.learner import is_full_attention
from trainer.rl.replay import chunked_token_logprobs
from trainer.rl.rollouts import sampling_kwargs

if TYPE_CHECKING:
    from trainer.align.config import AlignConfig
    from trainer.config import TrainConfig
    from trainer.evaluation.evaluate import GenerateFn
    from trainer.rewards.registry import Reward, RewardFn
    from trainer.rl.value_model import Policy

_DEGENERATE = re.compile(r"(.{1,4}?)\1{3,}", re.DOTALL)


def is_degenerate(text: str) -> bool:
    """One unit of 1-4 characters (or one word) repeated 4+ times makes up the whole answer."""
    t = text.strip()
    if not t:
        return False
    words = t.split()
    return bool(_DEGENERATE.fullmatch(t)) or (len(words) >= 4 and len(set(words)) == 1)


def answer_monitors(result: SettingResult) -> dict[str, float]:
    comps = [c for p in result.problems for c in p["completions"]]
    n = max(len(comps), 1)
    return {"mean_length": result.mean_response_tokens,
            "stop_rate": sum(c["finish_reason"] == "stop" for c in comps) / n,
            "empty_frac": sum(not c["text"].strip() for c in comps) / n,
            "degenerate_frac": sum(is_degenerate(c["text"]) for c in comps) / n}


@torch.no_grad()
def target_logprobs(module: Policy, rows: Rows, mask_id: int, temperature: float, chunk: int = 1024) -> torch.Tensor:
    """log p of every row target under a plain (unsharded) module: [R, L], zeros off-target."""
    dev = next(module.parameters()).device
    if is_full_attention(module):  # LLaDA / Dream: one bidirectional canvas per trace step
        hidden = full_replay_hidden(module, rows, dev)
    else:
        hidden = module(rows.noisy.to(dev), position_ids=rows.pos.to(dev), clean_ids=rows.clean.to(dev),
                        valid=rows.valid.to(dev), output="hidden")  # [R, L, D]
    target = rows.target.to(dev)
    lp, _, _ = chunked_token_logprobs(module.lm_head, hidden[target], rows.clean.to(dev)[target], mask_id,
                                      temperature, chunk=chunk, bias=rows.token_bias(target))
    return torch.zeros(target.shape, dtype=torch.float32).masked_scatter(target.cpu(), lp.float().cpu())


@dataclass
class GateResult:
    passed: bool
    reasons: list[str]
    candidate: dict[str, float]
    serving: dict[str, float]
    checks: dict[str, bool] = field(default_factory=dict)


class Gate:
    def __init__(self, cfg: AlignConfig, train_cfg: TrainConfig, examples: list[dict], reward_fn: RewardFn | Reward,
                 prompt_ids_of: Callable[[dict], list[int]], mask_id: int,
                 block_size: int, pad_id: int) -> None:
        self.cfg, self.train_cfg, self.examples, self.reward_fn = cfg, train_cfg, examples, reward_fn
        self.prompt_ids_of, self.mask_id, self.block_size, self.pad_id = prompt_ids_of, mask_id, block_size, pad_id
        self.prompts = [prompt_ids_of(e) for e in examples]

    def scores(self, generate_fn: GenerateFn) -> dict[str, float]:
        """Greedy held-out accuracy and the answer monitors of whatever `generate_fn` serves."""
        t = self.train_cfg
        setting = DecodingSetting(t.strategy, t.denoise_steps or None, t.threshold if t.strategy == "dynamic" else None)
        (r,) = evaluate([], self.examples, self.reward_fn, [setting], max_tokens=t.max_tokens, temperature=0.0,
                        stop=t.stop, stop_token_ids=t.stop_token_ids, prompts=self.prompts, generate_fn=generate_fn)
        return {"accuracy": r.pass_at[1], "reward": r.mean_reward, **answer_monitors(r),
                "eval_seconds": r.wall_seconds}

    def kl(self, generate_fn: GenerateFn, policy: Policy, reference: Policy, seed: int = 0) -> dict[str, float]:
        """KL(candidate || serving) per token on sampled held-out rollouts, by trace replay."""
        prompts = self.prompts[:self.cfg.kl_prompts]
        rollouts = generate_fn(prompts, 1, seed=seed, **sampling_kwargs(self.train_cfg))
        rollouts = [r for r in rollouts if r.completion_ids]
        if not rollouts:
            return {"kl": 0.0, "kl_k1": 0.0, "kl_tokens": 0}
        rows = (build_full_rows(rollouts, self.mask_id, self.pad_id) if is_full_attention(policy)
                else build_rows(rollouts, self.block_size, self.mask_id, self.pad_id, 1))
        temp, chunk = self.train_cfg.temperature, self.train_cfg.logprob_chunk
        cand = target_logprobs(policy, rows, self.mask_id, temp, chunk)
        ref = target_logprobs(reference, rows, self.mask_id, temp, chunk)
        d = (ref - cand)[rows.target].double()  # log ref/cand at the candidate's own samples
        return {"kl": float((d.exp() - d - 1).mean()), "kl_k1": float((-d).mean()), "kl_tokens": int(d.numel())}

    def check(self, cand: dict[str, float], serving: dict[str, float]) -> GateResult:
        c = self.cfg
        checks = {
            "accuracy": cand["accuracy"] >= serving["accuracy"] - c.tolerance - 1e-9,
            "kl": cand.get("kl", 0.0) <= c.kl_budget,
            "length": _within_ratio(cand["mean_length"], serving["mean_length"], c.max_length_ratio),
            "stop_rate": cand["stop_rate"] >= serving["stop_rate"] - c.max_stop_rate_drop - 1e-9,
            "empty": cand["empty_frac"] <= c.max_empty_frac,
            "degenerate": cand["degenerate_frac"] <= c.max_degenerate_frac,
        }
        why = {
            "accuracy": f"held-out accuracy {cand['accuracy']:.3f} < serving {serving['accuracy']:.3f} - "
                        f"tolerance {c.tolerance}",
            "kl": f"KL to the serving version {cand.get('kl', 0.0):.4f} > kl_budget {c.kl_budget}",
            "length": f"mean length {cand['mean_length']:.2f} vs serving {serving['mean_length']:.2f} "
                      f"(max_length_ratio {c.max_length_ratio})",
            "stop_rate": f"stop rate {cand['stop_rate']:.3f} < serving {serving['stop_rate']:.3f} - "
                         f"{c.max_stop_rate_drop}",
            "empty": f"empty answers {cand['empty_frac']:.3f} > max_empty_frac {c.max_empty_frac}",
            "degenerate": f"degenerate answers {cand['degenerate_frac']:.3f} > max_degenerate_frac "
                          f"{c.max_degenerate_frac}",
        }
        reasons = [why[k] for k, ok in checks.items() if not ok]
        return GateResult(not reasons, reasons, dict(cand), dict(serving), checks)


def _within_ratio(x: float, ref: float, ratio: float) -> bool:
    """x within a factor `ratio` of ref (anything goes when the reference answers are all empty)."""
    if ref <= 0:
        return True
    return x > 0 and 1.0 / ratio <= x / ref <= ratio
