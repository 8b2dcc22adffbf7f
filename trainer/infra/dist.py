"""Rank awareness of the trainer, in one place: who this process is, who speaks for the job,
and the few collectives an RL step needs.

    ranks = Ranks.init()                      # RANK/WORLD_SIZE/LOCAL_RANK from torchrun, the
                                              # DeepSpeed launcher or `dlrl train nproc=N`; alone: 1 rank
    mine = ranks.shard(num_prompts)           # this rank's slice of the step's prompts (whole groups)
    tokens, reward = ranks.sum([n_tok, r])    # all-reduce (global counts: same update as one rank)
    version = ranks.broadcast(version)        # rank 0's value everywhere
    result = ranks.on_main(fn)                # rank 0 runs fn; its result (or its error) reaches all

CPU ranks use gloo, CUDA ranks NCCL with `LOCAL_RANK` as the device. Rank 0 alone talks to the
servers' control plane, evaluates, logs and exports; every rank joins the collectives (ZeRO
gathers, checkpoints, the gradient all-reduce inside DeepSpeed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

log = logging.getLogger("dlrl.train")
T = TypeVar("T")


class RankError(RuntimeError):
    """Rank 0 failed at a step all ranks wait on; the message is its error, `kind` its type name."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


def select_device(device: str) -> None:
    """Pin the trainer's device before the process group exists (`train.device`): "cpu" runs
    gloo + DeepSpeed's CPU accelerator even where a GPU is visible, "cuda" requires one, "auto"
    leaves it to `DS_ACCELERATOR` / the hardware. Ranks started from here inherit the choice."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' but no CUDA device is visible")
    if device != "auto":
        os.environ["DS_ACCELERATOR"] = device


def uses_cuda() -> bool:
    """Whether this trainer runs on CUDA: a GPU is visible and DS_ACCELERATOR does not say cpu."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def init_process_group() -> None:
    """The job's default process group (through DeepSpeed, which the engines need anyway).
    Under a launcher (RANK / WORLD_SIZE set) it rendezvouses through env://; a process no
    launcher started is a group of one over an in-memory store: no port to race for, and no
    RANK / WORLD_SIZE left in its environment for the processes it starts."""
    if torch.distributed.is_initialized():
        return
    has_cuda = uses_cuda()
    if not has_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    backend = "nccl" if has_cuda else "gloo"
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from trainer.extensions import announced_build, ensure_extensions_dir

    ensure_extensions_dir()  # before DeepSpeed builds its ops: one stable cache (issue 38)
    from trainer.infra.ds_import import import_deepspeed

    deepspeed = import_deepspeed()  # after the env: DS_ACCELERATOR is read on first use

    if not launched:
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine reads it
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    with announced_build(cpu=not has_cuda):
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def init(cls) -> Ranks:
        init_process_group()
        dist = torch.distributed
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where collective tensors live (NCCL needs them on this rank's GPU)."""
        if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    # ------------------------------------------------------------------ sharding
    def shard(self, num_items: int) -> slice:
        """Contiguous, near-equal slice of `num_items` for this rank (the first ranks get one more)."""
        base, extra = divmod(num_items, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    # ------------------------------------------------------------------ collectives
    def _reduce(self, values: list[float], op: torch.distributed.ReduceOp.RedOpType) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, torch.distributed.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, torch.distributed.ReduceOp.MAX)

    def broadcast(self, obj: T) -> T:
        """Rank 0's (picklable, small) object on every rank."""
        if self.world_size == 1:
            return obj
        box: list[Any] = [obj if self.is_main else None]  # filled with rank 0's object on every rank
        torch.distributed.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's (picklable, small) object, in rank order."""
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def on_main(self, fn: Callable[[], T], while_waiting: Callable[[str], None] | None = None) -> T:
        """Run `fn` on rank 0 only; every rank returns its result, or raises its error.

        `while_waiting(command)` runs on the other ranks for each command rank 0 announces with
        `announce` while `fn` runs (e.g. "gather": join a ZeRO-3 parameter gather)."""
        if self.world_size == 1:
            return fn()
        if self.is_main:
            try:
                result = ("ok", fn())
            except BaseException as e:
                self.broadcast(("error", (type(e).__name__, f"{e}")))
                raise
            return self.broadcast(result)[1]
        while True:
            message: tuple[str, Any] = self.broadcast(("", None))  # rank 0's; this placeholder is not sent
            kind, payload = message
            if kind == "ok":
                return payload
            if kind == "error":
                raise RankError(f"rank 0: {payload[1]}", payload[0])
            if while_waiting is None:
                raise RankError(f"rank 0 asked for {kind!r} and this rank has nothing to join")
            while_waiting(kind)

    def announce(self, command: str) -> None:
        """Rank 0, inside `on_main`: make the waiting ranks run `while_waiting(command)`."""
        if self.world_size > 1:
            self.broadcast((command, None))
