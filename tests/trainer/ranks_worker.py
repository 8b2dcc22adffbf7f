"""Worker for tests/trainer/test_ranks.py, run under torchrun: one RL update of a tiny policy on a fixed
batch of rollouts, for several objectives and ZeRO stages, on however many ranks it is given.

    torchrun --standalone --nproc_per_node 2 tests/trainer/ranks_worker.py OUT_DIR

Every rank generates the same global batch (same seed, same weights), keeps its own shard of
whole prompt groups, and runs `trainer.loop.learn` (the real step: rewards, advantages,
replay, mini/micro-batches, DeepSpeed steps). Rank 0 saves the updated policy (and value
model) weights and the step's metrics per case to OUT_DIR/<case>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by torchrun as a script

import torch

CASES = [(obj, stage) for obj in ("tracerl", "dipo_kl", "value") for stage in (0, 2, 3)]
NUM_PROMPTS, GROUP = 6, 4


def make_policy():
    from dllm.config import SDARConfig
    from dllm.model import SDARForCausalLM

    torch.manual_seed(0)
    cfg = SDARConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=4, mask_token_id=63,
                     eos_token_id=0, rope_theta=10000.0)
    return SDARForCausalLM(cfg)


def global_rollouts(policy) -> list:
    """The step's rollouts, identical on every rank (one process each, same seeds)."""
    from dllm.decoding import generate
    from dllm.sampling import SamplingParams
    from rollout_client.protocol.rollout import Rollout

    prompts = [[1 + p, 2 + p, 3, 4 + 2 * p, 5][: 2 + p % 4] for p in range(NUM_PROMPTS)]
    params = [SamplingParams(max_tokens=9, strategy="static", steps=2, seed=100 * p + i)
              for p in range(NUM_PROMPTS) for i in range(GROUP)]
    outs = generate(policy.eval(), [p for p in prompts for _ in range(GROUP)], params, eos_ids=[7])
    return [Rollout(prompt_index=k // GROUP, sample_index=k % GROUP, prompt_ids=o.prompt_ids,
                    completion_ids=o.completion_ids, text=" ".join(map(str, o.completion_ids)),
                    finish_reason=o.finish_reason, version=0,
                    trace=o.trace.model_copy(deep=True)) for k, o in enumerate(outs)]


def run_case(ranks, objective: str, stage: int, rollouts: list) -> dict:
    from trainer.config import TrainConfig
    from trainer.infra.ds_engine import named_full_params
    from trainer.loop import learn
    from trainer.rl.rollouts import Batch
    from trainer.run import _build_learner

    cfg = TrainConfig(objective="dipo" if objective == "dipo_kl" else "tracerl", zero_stage=stage,
                      kl_coef=0.5 if objective == "dipo_kl" else 0.0, use_value_model=objective == "value",
                      gamma=1.0, lam=0.9, shrink=2 if objective == "value" else 1, value_lr=1e-3, lr=1e-3,
                      group_size=GROUP, updates_per_step=2, grad_accum=2, filter_zero_variance=True, seed=0)
    policy = make_policy()
    learner = _build_learner(cfg, ranks, policy)
    shard = ranks.shard(NUM_PROMPTS)
    examples = [{"prompt": str(p), "answer": ""} for p in range(NUM_PROMPTS)]
    batch = Batch(examples[shard], rollouts[shard.start * GROUP: shard.stop * GROUP], shard.start * GROUP,
                  NUM_PROMPTS * GROUP, 0.0)
    from tests.helpers import parity_reward

    run = SimpleNamespace(cfg=cfg, ranks=ranks, learner=learner, reward_fn=parity_reward, version=0,
                          block_size=4, mask_id=63, pad_id=0, generator=torch.Generator().manual_seed(0))
    metrics = learn(run, batch, step=0)
    out = {"policy": dict(named_full_params(learner.engine)), "metrics": metrics}
    if learner.value is not None:
        out["value"] = dict(named_full_params(learner.value))
    return out


def main(out_dir: str) -> None:
    from trainer.infra.dist import Ranks

    ranks = Ranks.init()
    rollouts = global_rollouts(make_policy())
    for objective, stage in CASES:
        result = run_case(ranks, objective, stage, rollouts)
        if ranks.is_main:
            torch.save(result, Path(out_dir) / f"{objective}-zero{stage}.pt")
    ranks.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
