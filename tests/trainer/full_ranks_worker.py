"""Worker for tests/trainer/test_full_attention_train.py: one RL update (`trainer.loop.learn`, the real step)
of a tiny LLaDA-layout policy on a fixed batch of full-attention rollouts, per case; run in-process for one
rank, or under torchrun for two (LLaDA and Dream, exact and prefix cache, the value model):

    torchrun --standalone --nproc_per_node 2 tests/trainer/full_ranks_worker.py OUT_DIR

Every rank decodes the same global batch (same seeds and weights, dllm.full.decoding), keeps its own shard of
whole prompt groups and runs `learn`; rank 0 saves the updated policy and the step's metrics per case to
OUT_DIR/<case>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by torchrun as a script

import torch

# (name, objective, zero stage, cache mode, extra options: `family` (default llada), then train options)
CASES: list[tuple[str, str, int, str, dict[str, Any]]] = [
    ("tracerl-zero2", "tracerl", 2, "exact", {}),
    ("dipo_kl-zero3", "dipo", 3, "exact", {"kl_coef": 0.5}),
    ("dream-tracerl-tis-zero2", "tracerl", 2, "prefix", {"family": "dream", "is_correction": "tis"}),
    ("dream-value-zero3", "tracerl", 3, "exact", {"family": "dream", "use_value_model": True, "lam": 0.95}),
]
NUM_PROMPTS, GROUP = 4, 4


def make_policy(family: str = "llada") -> Any:
    from dllm.embedded.full_folders import tiny_full_config
    from dllm.full.model import FullAttentionLM

    torch.manual_seed(0)
    return FullAttentionLM(tiny_full_config(family, block_size=4, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4))


def global_rollouts(policy: Any, cache_mode: str = "exact", further_horizon: int | None = -1) -> list:
    """The step's rollouts, identical on every rank (one process each, same seeds); `further_horizon`: the
    prefix cache's window (-1: the family's official value)."""
    from dllm.full.decoding import generate_full
    from dllm.sampling import SamplingParams
    from rollout_client.protocol.rollout import Rollout

    prompts = [[10 + p, 11, 12 + 2 * p, 13][: 2 + p % 3] for p in range(NUM_PROMPTS)]
    params = [SamplingParams(max_tokens=7, strategy="static", steps=2, seed=100 * p + i)
              for p in range(NUM_PROMPTS) for i in range(GROUP)]
    outs = generate_full(policy.eval(), [p for p in prompts for _ in range(GROUP)], params, cache_mode=cache_mode,
                         eos_ids=[7], further_horizon=further_horizon)
    return [Rollout(prompt_index=k // GROUP, sample_index=k % GROUP, prompt_ids=o.prompt_ids,
                    completion_ids=o.completion_ids, text=" ".join(map(str, o.completion_ids)),
                    finish_reason=o.finish_reason, version=0,
                    trace=o.trace.model_copy(deep=True)) for k, o in enumerate(outs)]


def run_case(ranks: Any, objective: str, stage: int, rollouts: list, family: str = "llada", **options: Any) -> dict:
    from tests.helpers import parity_reward
    from trainer.config import TrainConfig
    from trainer.infra.ds_engine import named_full_params
    from trainer.loop import learn
    from trainer.rl.rollouts import Batch
    from trainer.run import _build_learner

    cfg = TrainConfig(objective=objective, zero_stage=stage, lr=1e-3, group_size=GROUP, updates_per_step=2,
                      grad_accum=2, seed=0, **options)
    policy = make_policy(family)
    learner = _build_learner(cfg, ranks, policy)
    shard = ranks.shard(NUM_PROMPTS)
    examples = [{"prompt": str(p), "answer": ""} for p in range(NUM_PROMPTS)]
    batch = Batch(examples[shard], rollouts[shard.start * GROUP: shard.stop * GROUP], shard.start * GROUP,
                  NUM_PROMPTS * GROUP, 0.0)
    cfg_model = policy.config
    run = SimpleNamespace(cfg=cfg, ranks=ranks, learner=learner, reward_fn=parity_reward, version=0,
                          block_size=cfg_model.block_size, mask_id=cfg_model.mask_token_id, pad_id=cfg_model.pad_token_id,
                          generator=torch.Generator().manual_seed(0))
    metrics = learn(run, batch, step=0)  # type: ignore[arg-type]
    out = {"policy": dict(named_full_params(learner.engine)), "metrics": metrics}
    if learner.value is not None:
        out["value"] = dict(named_full_params(learner.value))
    return out


def main(out_dir: str) -> None:
    from trainer.infra.dist import Ranks

    ranks = Ranks.init()
    for name, objective, stage, mode, options in CASES:
        family = options.get("family", "llada")
        result = run_case(ranks, objective, stage, global_rollouts(make_policy(family), mode), **options)
        if ranks.is_main:
            torch.save(result, Path(out_dir) / f"{name}.pt")
    ranks.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
