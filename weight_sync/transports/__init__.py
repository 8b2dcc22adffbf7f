"""Data planes of the weight-sync channel: `shm` (same host), `dist` (torch.distributed), `http`,
`cuda_ipc` (same node, GPU memory shared by IPC handle).

Each module has a sender half (used by weight_sync.sender) and a receiver half (used by
weight_sync.receiver). The control plane (begin/commit/abort) is always admin HTTP.
"""

import typing

from weight_sync.protocol import Transport

TRANSPORTS = typing.get_args(Transport)
