"""torch.distributed data plane: a side process group (trainer = rank 0, servers = 1..N).

Sender (trainer):                                   Receiver (each server):
    group = DistSender(addr="10.0.0.5")                 recv = DistReceiver()
    opts, fresh = group.prepare(num_servers=2, backend) recv.connect(opts)   # POST /weights/connect:
    # POST /weights/connect(opts[i]) to server i        #   joins in a thread, once
    group.connect(device)     # once, at connect        recv.check(opts)     # begin: holds the group?
    work = group.broadcast(bucket)                      recv.start(staging, on_bucket, on_done, stop)

The group is its own ProcessGroupGloo / ProcessGroupNCCL built from a private TCPStore
that the trainer hosts on the configured address (a socket bound to `addr` is handed to
the store, so a server on another host joins through that address, and nothing listens
elsewhere); gloo binds its own sockets to `addr` on the trainer and, on a server, to the
local address that routes to `addr`. It is not `torch.distributed.new_group`: servers and
trainer are separate jobs and the trainer's DeepSpeed default group stays untouched.

The group is built once (connect) and kept across updates; `group_id` (a uuid, also the
store prefix) tells a server whether it holds it. After an aborted or failed update both
sides drop it (the collective sequence is broken) and the next push builds a fresh one.
Nothing waits forever: a server joins only once the trainer has announced itself in the
store (polling, so an abort stops it), receives by polling `Work.is_completed()` against
an abort flag, and every gloo operation has the group's timeout. When the trainer shuts
its group down (abort, exit, death) the servers' pending receive fails within a second, so
their threads and the group's gloo threads end: aborted updates leak no threads.
NCCL (CUDA only, not exercised on the CPU test box): groups are connected eagerly on the
staging device (`eager_connect_single_device`, what `init_process_group(device_id=)` does).
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from weight_sync.errors import ManifestError, UpdateConflict, UpdateFailed

SENDER_KEY = "sender_ready"
POLL_S = 0.0005


class Aborted(UpdateFailed):
    """The update was aborted while its data was in flight."""


def local_address_for(addr: str) -> str:
    """The address of this host on the route to `addr` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _listen_fd(addr: str, port: int) -> int:
    """A listening socket bound to `addr` only, for the TCPStore to adopt."""
    sock = socket.create_server((addr, port), backlog=128)
    return sock.detach()


def _make_group(store: Any, rank: int, world_size: int, backend: str, host: str, timeout_s: float,
                device: torch.device | None = None) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        if device is not None and device.type == "cuda":
            pg.eager_connect_single_device(device)  # bind the communicator to the staging GPU
        return pg
    if backend != "gloo":
        raise ManifestError(f"options.backend: expected 'gloo' or 'nccl', got {backend!r}")
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # in torch, not in its stubs
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _broadcast(pg: Any, buf: torch.Tensor) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([buf], opts)


class DistSender:
    """Rank 0: hosts the TCPStore on `addr`, owns the side group, broadcasts buckets."""

    def __init__(self, addr: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0):
        self.addr, self.port, self.timeout_s = addr, port, timeout_s
        self.store: Any = None
        self.pg: Any = None
        self.group_id = ""
        self.key: tuple[int, str] | None = None  # (world_size, backend) of the group

    def prepare(self, num_servers: int, backend: str) -> tuple[list[dict[str, Any]], bool]:
        """Connect options for each server (server i gets rank i+1), and whether the group is new."""
        world_size = num_servers + 1
        fresh = self.pg is None or self.key != (world_size, backend)
        if fresh:
            self.close()
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self.store = dist.TCPStore(self.addr, self.port, None, True, timeout, wait_for_workers=False,
                                       master_listen_fd=_listen_fd(self.addr, self.port))
            self.group_id = f"dlrl_ws_{uuid.uuid4().hex[:12]}"
            self.key = (world_size, backend)
        base = {"addr": self.addr, "port": self.store.port, "world_size": world_size, "backend": backend,
                "group_id": self.group_id, "timeout_s": self.timeout_s}
        return [{**base, "rank": i + 1} for i in range(num_servers)], fresh

    def connect(self, device: torch.device | None = None) -> None:
        """Build the group (blocks until every server joined); no-op when built."""
        if self.pg is None:
            assert self.key is not None, "prepare() first"
            world_size, backend = self.key
            store = dist.PrefixStore(self.group_id, self.store)
            store.set(SENDER_KEY, "1")  # servers start joining when they see it
            self.pg = _make_group(store, 0, world_size, backend, self.addr, self.timeout_s, device)

    def broadcast(self, buf: torch.Tensor) -> Any:
        """Start broadcasting `buf` ([nbytes] uint8) to all servers; returns the Work to wait on."""
        return _broadcast(self.pg, buf)

    def close(self) -> None:
        """Shut the group down: the servers' pending receives fail at once and their threads end."""
        pg, self.pg, self.key = self.pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort teardown of a possibly broken group
                pass
        self.store = None


class DistReceiver:
    """Rank >= 1: joins the sender's group (at connect, in a thread) and receives buckets in a thread."""

    def __init__(self) -> None:
        self.pg: Any = None
        self.group_id = ""
        self._store: Any = None
        self._joining: threading.Thread | None = None
        self._join_error = ""
        self._stop = threading.Event()  # stops a pending join

    @staticmethod
    def validate(options: dict[str, Any]) -> None:
        for key in ("addr", "port", "world_size", "rank", "group_id", "backend"):
            if key not in options:
                raise ManifestError(f"options.{key}: missing (dist transport)")
        world, rank = options["world_size"], options["rank"]
        if not (isinstance(world, int) and isinstance(rank, int) and 1 <= rank < world):
            raise ManifestError(f"options.rank: need integers 1 <= rank < world_size, got {rank!r}, {world!r}")
        if not isinstance(options["port"], int) or not 0 < options["port"] < 65536:
            raise ManifestError(f"options.port: expected a TCP port, got {options['port']!r}")
        if options["backend"] not in ("gloo", "nccl"):
            raise ManifestError(f"options.backend: expected 'gloo' or 'nccl', got {options['backend']!r}")
        if options["backend"] == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ManifestError("options.backend: 'nccl' is not available on this server (no CUDA/NCCL)")

    def connect(self, options: dict[str, Any], device: torch.device | None = None) -> None:
        """Start joining the group of `options` in a thread (the sender builds its side meanwhile)."""
        self.validate(options)
        if options["group_id"] == self.group_id and (self.pg is not None or self._joining is not None):
            return
        self.drop()
        stop = self._stop = threading.Event()
        self.group_id = options["group_id"]
        self._join_error = ""
        self._joining = threading.Thread(target=self._join, args=(options, device, stop), daemon=True,
                                         name="weight-sync-dist-join")
        self._joining.start()

    def _join(self, options: dict[str, Any], device: torch.device | None, stop: threading.Event) -> None:
        timeout_s = float(options.get("timeout_s", 60))
        try:
            store = dist.TCPStore(options["addr"], int(options["port"]), None, False,
                                  datetime.timedelta(seconds=min(timeout_s, 30.0)))
            prefixed = dist.PrefixStore(options["group_id"], store)
            deadline = time.monotonic() + timeout_s
            while not prefixed.check([SENDER_KEY]):
                if stop.is_set() or time.monotonic() > deadline:
                    raise UpdateFailed("dist: the trainer never built its side of the group")
                time.sleep(0.05)
            pg = _make_group(prefixed, int(options["rank"]), int(options["world_size"]), options["backend"],
                             local_address_for(options["addr"]), timeout_s, device)
            if stop.is_set() or self.group_id != options["group_id"]:
                pg.shutdown()
                return
            self.pg, self._store = pg, store
        except BaseException as e:  # noqa: BLE001 - reported to the next begin (as text: no cycles)
            self._join_error = f"{type(e).__name__}: {e}"

    def check(self, options: dict[str, Any]) -> None:
        """Begin: the options must name the group this server joined (409 otherwise: reconnect)."""
        self.validate(options)
        joining = self._joining
        if joining is not None and options["group_id"] == self.group_id:
            joining.join(float(options.get("timeout_s", 60)))
        if self.pg is None or options["group_id"] != self.group_id:
            why = f" (join failed: {self._join_error})" if self._join_error else ""
            raise UpdateConflict(f"options.group_id: dist group {options['group_id']!r} is not joined here"
                                 f"{why}; the sender must connect again")

    def start(self, staging: list[torch.Tensor], on_bucket: Callable[[int], None],
              on_done: Callable[[BaseException | None], None], stop: threading.Event) -> threading.Thread:
        """Receive every bucket into `staging` (list of [nbytes_i] uint8) in a daemon thread."""
        pg = self.pg

        def run() -> None:
            try:
                for i, buf in enumerate(staging):
                    work = _broadcast(pg, buf)
                    while not work.is_completed():
                        if stop.is_set():
                            raise Aborted("aborted while receiving")
                        time.sleep(POLL_S)
                    work.wait()  # raises the transport error, if any
                    on_bucket(i)
            except BaseException as e:  # noqa: BLE001 - reported to the receiver; the group is dropped
                if self.pg is pg:
                    self.drop()
                # a message, not the exception: its traceback would keep this frame, and so the
                # group and its gloo threads, alive in a reference cycle until a garbage collection
                on_done(UpdateFailed(f"{type(e).__name__}: {e}"))
                return
            on_done(None)

        thread = threading.Thread(target=run, name="weight-sync-dist", daemon=True)
        thread.start()
        return thread

    def drop(self) -> None:
        """Forget the group (a broken collective sequence); a pending receive ends with the sender's."""
        self._stop.set()
        pg, self.pg, self.group_id, self._joining, self._store = self.pg, None, "", None, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self.drop()
