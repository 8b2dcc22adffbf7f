"""One RL update (`trainer.loop.learn`, the real step: rewards, advantages, replay rows, mini/micro-batches,
DeepSpeed steps) of a tiny policy on a fixed batch of rollouts, per case, on however many ranks it is given:
in-process for one rank (tests call `run_case`), or under torchrun for two (tests/trainer/test_ranks.py):

    torchrun --standalone --nproc_per_node 2 tests/trainer/ranks_worker.py OUT_DIR

Two families of cases: `sdar` (a block-diffusion SDAR policy: TraceRL, DiPO with KL to the reference and
TraceRL with the value model, each at ZeRO-0/2/3) and `full` (a LLaDA-layout full-attention policy from
dllm.full.decoding's traces: TraceRL at ZeRO-2, DiPO with KL at ZeRO-3) and `dream` (a Dream-layout one: TraceRL
on prefix-cache rollouts with TIS at ZeRO-2, TraceRL with the value model at ZeRO-3); the full-attention
one-rank tests are in test_full_attention_train.py. Every rank decodes the same global batch (same seeds and weights), keeps its
own shard of whole prompt groups and runs `learn`; rank 0 saves the updated policy (and value model), and
the step's metrics, per case to OUT_DIR/<family>-<case>.pt. One torchrun runs every family: the launch,
DeepSpeed's import and the process group are paid once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by torchrun as a script

import torch


@dataclass(frozen=True)
class Case:
    name: str
    objective: str
    zero_stage: int
    cache_mode: str = "exact"  # the full-attention sampler's cache mode (SDAR traces are exact)
    options: tuple[tuple[str, Any], ...] = ()  # further TrainConfig fields


def _sdar_policy() -> Any:
    from dllm.model import SDARForCausalLM
    from tests.helpers import tiny_config

    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config())


def _full_policy(family: str = "llada") -> Any:
    from dllm.embedded.full_folders import tiny_full_config
    from dllm.full.model import FullAttentionLM

    torch.manual_seed(0)
    return FullAttentionLM(tiny_full_config(family, block_size=4, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4))


def _sdar_decode(policy: Any, prompts: list[list[int]], params: list, cache_mode: str,
                 further_horizon: int | None = -1) -> list:
    from dllm.decoding import generate

    return generate(policy.eval(), prompts, params, eos_ids=[7])


def _full_decode(policy: Any, prompts: list[list[int]], params: list, cache_mode: str,
                 further_horizon: int | None = -1) -> list:
    """`further_horizon`: the prefix cache's window (-1: the family's official value)."""
    from dllm.full.decoding import generate_full

    return generate_full(policy.eval(), prompts, params, cache_mode=cache_mode, eos_ids=[7],
                         further_horizon=further_horizon)


@dataclass(frozen=True)
class Family:
    make_policy: Callable[[], Any]
    decode: Callable[..., list]  # (policy, prompts, params, cache_mode, further_horizon=-1) -> outputs
    prompts: list[list[int]]
    group: int
    max_tokens: int
    pad_id: int | None  # None: the policy config's pad_token_id
    options: tuple[tuple[str, Any], ...]  # TrainConfig fields of every case
    cases: list[Case]

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)


_VALUE = (("use_value_model", True), ("shrink", 2))
FAMILIES: dict[str, Family] = {
    "sdar": Family(
        _sdar_policy, _sdar_decode, [[1 + p, 2 + p, 3, 4 + 2 * p, 5][: 2 + p % 4] for p in range(6)], group=4,
        max_tokens=9, pad_id=0,
        options=(("gamma", 1.0), ("lam", 0.9), ("value_lr", 1e-3), ("filter_zero_variance", True)),
        cases=[Case(f"{name}-zero{stage}", objective, stage, options=options)
               for name, objective, options in (("tracerl", "tracerl", ()), ("dipo_kl", "dipo", (("kl_coef", 0.5),)),
                                                ("value", "tracerl", _VALUE))
               for stage in (0, 2, 3)]),
    "full": Family(
        _full_policy, _full_decode, [[10 + p, 11, 12 + 2 * p, 13][: 2 + p % 3] for p in range(4)], group=4,
        max_tokens=7, pad_id=None, options=(),
        cases=[Case("tracerl-zero2", "tracerl", 2), Case("dipo_kl-zero3", "dipo", 3, options=(("kl_coef", 0.5),))]),
    "dream": Family(
        lambda: _full_policy("dream"), _full_decode, [[10 + p, 11, 12 + 2 * p, 13][: 2 + p % 3] for p in range(4)],
        group=4, max_tokens=7, pad_id=None, options=(),
        cases=[Case("tracerl-tis-zero2", "tracerl", 2, "prefix", options=(("is_correction", "tis"),)),
               Case("value-zero3", "tracerl", 3, options=(("use_value_model", True), ("lam", 0.95)))]),
}


def make_policy(family: str = "sdar") -> Any:
    return FAMILIES[family].make_policy()


def global_rollouts(policy: Any, family: str = "sdar", cache_mode: str = "exact", further_horizon: int | None = -1) -> list:
    """The step's rollouts, identical on every rank (one process each, same seeds); `further_horizon`: the
    full-attention prefix cache's window (-1: the family's official value)."""
    from dllm.sampling import SamplingParams
    from rollout_client.protocol.rollout import Rollout

    fam = FAMILIES[family]
    group = fam.group
    params = [SamplingParams(max_tokens=fam.max_tokens, strategy="static", steps=2, seed=100 * p + i)
              for p in range(fam.num_prompts) for i in range(group)]
    outs = fam.decode(policy, [p for p in fam.prompts for _ in range(group)], params, cache_mode, further_horizon)
    return [Rollout(prompt_index=k // group, sample_index=k % group, prompt_ids=o.prompt_ids,
                    completion_ids=o.completion_ids, text=" ".join(map(str, o.completion_ids)),
                    finish_reason=o.finish_reason, version=0,
                    trace=o.trace.model_copy(deep=True)) for k, o in enumerate(outs)]


def run_case(ranks: Any, family: str, objective: str, stage: int, rollouts: list, **options: Any) -> dict:
    """One `learn` step of a fresh policy of `family` on this rank's shard of `rollouts`: the policy's (and
    value model's) full parameters afterwards and the step's metrics."""
    from tests.helpers import parity_reward
    from trainer.config import TrainConfig
    from trainer.infra.ds_engine import named_full_params
    from trainer.loop import learn
    from trainer.rl.rollouts import Batch
    from trainer.run import _build_learner

    fam = FAMILIES[family]
    n, group = fam.num_prompts, fam.group
    cfg = TrainConfig(objective=objective, zero_stage=stage, lr=1e-3, group_size=group, updates_per_step=2,
                      grad_accum=2, seed=0, **{**dict(fam.options), **options})
    policy = fam.make_policy()
    learner = _build_learner(cfg, ranks, policy)
    shard = ranks.shard(n)
    examples = [{"prompt": str(p), "answer": ""} for p in range(n)]
    batch = Batch(examples[shard], rollouts[shard.start * group: shard.stop * group], shard.start * group,
                  n * group, 0.0)
    model = policy.config
    run = SimpleNamespace(cfg=cfg, ranks=ranks, learner=learner, reward_fn=parity_reward, version=0,
                          block_size=model.block_size, mask_id=model.mask_token_id,
                          pad_id=model.pad_token_id if fam.pad_id is None else fam.pad_id,
                          generator=torch.Generator().manual_seed(0))
    metrics = learn(run, batch, step=0)  # type: ignore[arg-type]
    out = {"policy": dict(named_full_params(learner.engine)), "metrics": metrics}
    if learner.value is not None:
        out["value"] = dict(named_full_params(learner.value))
    return out


def run_named_case(ranks: Any, family: str, case: Case) -> dict:
    rollouts = global_rollouts(make_policy(family), family, case.cache_mode)
    return run_case(ranks, family, case.objective, case.zero_stage, rollouts, **dict(case.options))


def main(out_dir: str) -> None:
    from trainer.infra.dist import Ranks

    ranks = Ranks.init()
    for family, fam in FAMILIES.items():
        for case in fam.cases:
            result = run_named_case(ranks, family, case)
            if ranks.is_main:
                torch.save(result, Path(out_dir) / f"{family}-{case.name}.pt")
    ranks.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
