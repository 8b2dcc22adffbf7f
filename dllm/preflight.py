"""Checks every command runs before it loads weights (and `--check` runs too): each returns a
message naming the config key, or "" when all is well.

    problems = [port_problem("127.0.0.1", 8000, "server.port / --port"), model_problem(cfg.model, "server.model")]
    fail_early([p for p in problems if p])            # ValueError listing them all

`--check-config` skips these (only the command line and the config: what deploy manifests are
validated with on a machine that lacks the containers' files).
"""

from __future__ import annotations

import socket
from pathlib import Path


def port_problem(host: str, port: int, key: str) -> str:
    """"" when `host:port` can be bound now, else a message naming `key`."""
    if port == 0:
        return ""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return f"{key}: {host}:{port} is already in use ({e.strerror}); stop what listens there or choose another port"
    return ""


def model_problem(ref: str, key: str) -> str:
    """"" for "" (the embedded default), an existing folder, or a hub repo id; else a message."""
    from dllm.hub import is_repo_id

    if not ref or Path(ref).is_dir() or is_repo_id(ref):
        return ""
    if Path(ref).exists():
        return f"{key}: {ref!r} is not a directory (a Hugging Face model folder or a hub repo id org/name)"
    return f"{key}: {ref!r} does not exist (a Hugging Face model folder or a hub repo id org/name[@revision])"


def fail_early(problems: list[str]) -> None:
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("; ".join(problems))
