"""Data parallelism: 2 ranks make the same update as 1 rank with the same global batch, for
ZeRO-0/2/3 x (TraceRL, DiPO with KL to the reference, TraceRL with the value model), real
DeepSpeed and torch.distributed (gloo) under torchrun. Plus the rank helpers themselves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.infra.dist import Ranks

WORKER = Path(__file__).with_name("ranks_worker.py")


def _run_worker(nproc: int, out: Path) -> None:
    out.mkdir()
    # gloo on CPU ranks, GPU or not (two NCCL ranks cannot share one GPU)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(WORKER.parent.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(WORKER), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("ranks")
    for n in (1, 2):
        _run_worker(n, root / f"n{n}")
    return {1: root / "n1", 2: root / "n2"}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["tracerl", "dipo_kl", "value"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_two_ranks_make_the_same_update_as_one(results, objective, stage):
    one = torch.load(results[1] / f"{objective}-zero{stage}.pt", weights_only=False)
    two = torch.load(results[2] / f"{objective}-zero{stage}.pt", weights_only=False)
    from tests.trainer.ranks_worker import make_policy

    initial = dict(make_policy().hf_named_tensors())
    for part in ("policy", "value") if objective == "value" else ("policy",):
        for name, p in one[part].items():
            assert (p - two[part][name]).abs().max() <= 1e-5, (part, name)
        assert any(not torch.equal(p, initial[n]) for n, p in one["policy"].items())  # it did train
    assert one["metrics"]["num_samples"] == two["metrics"]["num_samples"] == 24
    for key, value in one["metrics"].items():  # metrics use global counts
        assert two["metrics"][key] == pytest.approx(value, abs=1e-5), key
    if objective == "dipo_kl":
        assert one["metrics"]["kl_ref"] > 0
    if objective == "value":
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
