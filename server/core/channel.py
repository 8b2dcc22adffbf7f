"""The local channel between API processes and the engine core: ZeroMQ over a Unix-domain socket.

    run_dir = make_run_dir()                       # private (0700) folder for the socket: removed at exit
    address = core_address(run_dir)                # ipc:///tmp/dlrl-serve-XXXX/core.sock
    sock = bind_core(ctx, address)                 # the core: one ROUTER for every API process
    sock = connect_api(ctx, address, index=0)      # an API process: one DEALER, identity b"api-0"

The core's ROUTER talks to each API process's DEALER by its identity: requests and calls one way,
a step's outputs and the replies the other way (server.core.messages). Outputs are never dropped
(no high-water mark towards the API processes: a dead one's queue goes with its connection);
towards the core the high-water mark is small, so a weight bucket streamed through the channel
(PUT /weights/bucket, http data plane) holds at most `DATA_HWM` chunks in flight and pushes back
on its HTTP client through TCP. ZeroMQ sockets belong to one event loop each (zmq.asyncio).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import zmq
import zmq.asyncio

DATA_HWM = 64  # messages queued towards the core per API process (a bucket's chunks wait beyond this)


def make_run_dir() -> Path:
    """A private folder for the channel's socket file (owner only)."""
    return Path(tempfile.mkdtemp(prefix="dlrl-serve-"))


def remove_run_dir(path: Path | str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def core_address(run_dir: Path | str) -> str:
    return f"ipc://{os.path.join(run_dir, 'core.sock')}"


def identity(index: int) -> bytes:
    return f"api-{index}".encode()


def bind_core(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    """The core's ROUTER: nothing it sends is dropped; what it receives is bounded per API process."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, DATA_HWM)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted API process takes its identity back
    sock.bind(address)
    return sock


def connect_api(ctx: zmq.asyncio.Context, address: str, index: int) -> zmq.asyncio.Socket:
    """An API process's DEALER (identity api-<index>)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity(index))
    sock.setsockopt(zmq.SNDHWM, DATA_HWM)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


__all__ = ["DATA_HWM", "bind_core", "connect_api", "core_address", "identity", "make_run_dir", "remove_run_dir"]
