"""torch.distributed data plane: a side process group (trainer = rank 0, servers = 1..N).

Sender (trainer):                                   Receiver (each server, in a thread):
    group = DistSender(addr="10.0.0.5")                 recv = DistReceiver()
    opts = group.prepare(num_servers=2, backend)        recv.start(opts, staging, on_bucket, on_done)
    # POST begin(opts[i]) to server i, then:            # joins (first time), then for each bucket
    group.connect()                                     #   broadcast(staging[i], root=0)
    work = group.broadcast(bucket)                      recv.close()

The group is its own ProcessGroupGloo / ProcessGroupNCCL built from a private TCPStore
(the trainer hosts it), not `torch.distributed.new_group`: servers and trainer are
separate jobs, and the trainer's DeepSpeed default group is left untouched. The group is
kept across updates; `group_id` (a uuid, also the store prefix) tells a server whether it
already belongs to it. After any failure both sides drop the group and the next update
builds a fresh one. Backend: gloo for CPU tensors, NCCL when buckets live on CUDA.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from weight_sync.errors import ManifestError, UpdateConflict

_LOOPBACK = ("127.", "localhost", "::1")


def _make_group(store: Any, rank: int, world_size: int, backend: str, addr: str, timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if backend != "gloo":
        raise ManifestError(f"options.backend: expected 'gloo' or 'nccl', got {backend!r}")
    opts = dist.ProcessGroupGloo._Options()
    loopback = addr.startswith(_LOOPBACK)
    device = (
        dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        if loopback
        else dist.ProcessGroupGloo.create_default_device()
    )
    opts._devices = [device]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _broadcast(pg: Any, buf: torch.Tensor) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([buf], opts)


class DistSender:
    """Rank 0: hosts the TCPStore, owns the side group, broadcasts buckets."""

    def __init__(self, addr: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0):
        self.addr, self.port, self.timeout_s = addr, port, timeout_s
        self.store: Any = None
        self.pg: Any = None
        self.group_id = ""
        self.key: tuple[int, str] | None = None  # (world_size, backend) of the cached group

    def prepare(self, num_servers: int, backend: str) -> list[dict[str, Any]]:
        """Begin options for each server (server i gets rank i+1). Reuses the cached group."""
        world_size = num_servers + 1
        fresh = self.pg is None or self.key != (world_size, backend)
        if fresh:
            self.close()
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self.store = dist.TCPStore(self.addr, self.port, None, True, timeout, wait_for_workers=False)
            self.group_id = f"dlrl_ws_{uuid.uuid4().hex[:12]}"
            self.key = (world_size, backend)
        base = {
            "addr": self.addr, "port": self.store.port, "world_size": world_size, "backend": backend,
            "group_id": self.group_id, "fresh": fresh, "timeout_s": self.timeout_s,
        }
        return [{**base, "rank": i + 1} for i in range(num_servers)]

    def connect(self) -> None:
        """Build the group (blocks until every server joined); no-op when cached."""
        if self.pg is None:
            assert self.key is not None, "prepare() first"
            world_size, backend = self.key
            store = dist.PrefixStore(self.group_id, self.store)
            self.pg = _make_group(store, 0, world_size, backend, self.addr, self.timeout_s)

    def broadcast(self, buf: torch.Tensor) -> Any:
        """Start broadcasting `buf` ([nbytes] uint8) to all servers; returns the Work to wait on."""
        return _broadcast(self.pg, buf)

    def close(self) -> None:
        pg, self.pg, self.key = self.pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort teardown of a possibly broken group
                pass
        self.store = None


class DistReceiver:
    """Rank >= 1: joins the sender's group (once) and receives buckets in a thread."""

    def __init__(self) -> None:
        self.pg: Any = None
        self.store: Any = None
        self.group_id = ""

    def check(self, options: dict[str, Any]) -> None:
        """Validate begin options; a non-fresh group this server does not hold is a conflict."""
        for key in ("addr", "port", "world_size", "rank", "group_id", "backend"):
            if key not in options:
                raise ManifestError(f"options.{key}: missing (dist transport)")
        world, rank = options["world_size"], options["rank"]
        if not (isinstance(world, int) and isinstance(rank, int) and 1 <= rank < world):
            raise ManifestError(f"options.rank: need integers 1 <= rank < world_size, got {rank!r}, {world!r}")
        if options["backend"] not in ("gloo", "nccl"):
            raise ManifestError(f"options.backend: expected 'gloo' or 'nccl', got {options['backend']!r}")
        if options["backend"] == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ManifestError("options.backend: 'nccl' is not available on this server (no CUDA/NCCL)")
        if not options.get("fresh", True) and options["group_id"] != self.group_id:
            raise UpdateConflict(
                f"options.group_id: dist group {options['group_id']!r} is unknown here "
                "(server restarted?); the sender must build a fresh group"
            )

    def _join(self, options: dict[str, Any]) -> Any:
        if options.get("fresh", True) or self.pg is None or options["group_id"] != self.group_id:
            self.close()
            timeout = datetime.timedelta(seconds=float(options.get("timeout_s", 300)))
            self.store = dist.TCPStore(options["addr"], int(options["port"]), None, False, timeout)
            prefixed = dist.PrefixStore(options["group_id"], self.store)
            self.pg = _make_group(
                prefixed, int(options["rank"]), int(options["world_size"]), options["backend"],
                options["addr"], float(options.get("timeout_s", 300)),
            )
            self.group_id = options["group_id"]
        return self.pg

    def start(
        self,
        options: dict[str, Any],
        staging: list[torch.Tensor],
        on_bucket: Callable[[int], None],
        on_done: Callable[[BaseException | None], None],
    ) -> threading.Thread:
        """Receive every bucket into `staging` (list of [nbytes_i] uint8) in a daemon thread."""

        def run() -> None:
            try:
                pg = self._join(options)
                for i, buf in enumerate(staging):
                    _broadcast(pg, buf).wait()
                    on_bucket(i)
            except BaseException as e:  # noqa: BLE001 - reported to the receiver, group dropped
                self.close()
                on_done(e)
                return
            on_done(None)

        thread = threading.Thread(target=run, name="weight-sync-dist", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        pg, self.pg, self.group_id = self.pg, None, ""
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                pass
        self.store = None
