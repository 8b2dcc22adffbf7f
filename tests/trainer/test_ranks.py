"""Data parallelism: 2 ranks make the same update as 1 rank with the same global batch, for
ZeRO-0/2/3 x (TraceRL, DiPO with KL to the reference, TraceRL with the value model) of an SDAR policy and
for a full-attention one, real DeepSpeed and torch.distributed (gloo) under torchrun (tests/trainer/ranks_worker.py).
Plus the rank helpers themselves."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_group
from tests.trainer.ranks_worker import FAMILIES, Case, make_policy, run_named_case
from trainer.infra.dist import Ranks

WORKER = Path(__file__).with_name("ranks_worker.py")
CASES = [(family, case) for family, fam in FAMILIES.items() for case in fam.cases]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Every case of ranks_worker.py (both families) on two ranks: one torchrun."""
    out = tmp_path_factory.mktemp("ranks")
    # gloo on CPU ranks, GPU or not (two NCCL ranks cannot share one GPU)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(WORKER.parents[2]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), str(out)]
    proc = run_group(cmd, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family,case", CASES, ids=[f"{family}-{case.name}" for family, case in CASES])
def test_two_ranks_make_the_same_update_as_one(two_ranks: Path, one_rank: Ranks, family: str, case: Case) -> None:
    """The same global batch on one rank (in this process) and on two (torchrun): the same update, and the
    same metrics (they use global counts). SDAR: TraceRL, DiPO + KL, TraceRL + value model at ZeRO-0/2/3;
    a full-attention (LLaDA-layout) policy: TraceRL at ZeRO-2, DiPO + KL at ZeRO-3."""
    one = run_named_case(one_rank, family, case)
    two = torch.load(two_ranks / f"{family}-{case.name}.pt", weights_only=False)
    assert one.keys() == two.keys()
    for part in one.keys() - {"metrics"}:  # the policy, and the value model when there is one
        for name, p in one[part].items():
            assert (p - two[part][name]).abs().max() <= 1e-5, (part, name)
    initial = dict(make_policy(family).hf_named_tensors())
    assert any(not torch.equal(p, initial[n]) for n, p in one["policy"].items())  # it did train
    fam = FAMILIES[family]
    assert one["metrics"]["num_samples"] == two["metrics"]["num_samples"] == fam.num_prompts * fam.group
    for key, value in one["metrics"].items():  # metrics use global counts
        assert two["metrics"][key] == pytest.approx(value, abs=1e-5), key
    if dict(case.options).get("kl_coef"):
        assert one["metrics"]["kl_ref"] > 0
    if dict(case.options).get("use_value_model"):
        assert "value_loss" in one["metrics"] and "explained_var" in one["metrics"]


@pytest.mark.parametrize("world,expected", [
    (1, [range(7)]),
    (2, [range(4), range(4, 7)]),
    (3, [range(3), range(3, 5), range(5, 7)]),
])
def test_shard_is_contiguous_and_covers_everything(world, expected):
    shards = [range(7)[Ranks(rank=r, world_size=world).shard(7)] for r in range(world)]
    assert shards == expected


def test_single_rank_collectives_are_local():
    r = Ranks()
    assert r.is_main and r.sum([1, 2.5]) == [1.0, 2.5] and r.max([3]) == [3.0]
    assert r.broadcast({"a": 1}) == {"a": 1} and r.all_gather(5) == [5]
    assert r.on_main(lambda: 7) == 7


def test_train_device_pins_the_trainer(monkeypatch):
    from trainer.infra.dist import select_device, uses_cuda

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    select_device("auto")
    assert "DS_ACCELERATOR" not in os.environ and uses_cuda() == torch.cuda.is_available()
    select_device("cpu")  # gloo + CPU tensors even on a GPU machine; torchrun ranks inherit it
    assert os.environ["DS_ACCELERATOR"] == "cpu" and not uses_cuda()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="train.device"):
            select_device("cuda")
