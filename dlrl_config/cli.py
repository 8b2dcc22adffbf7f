"""What every dlrl command line shares: the `--check` / `--check-config` / overrides arguments,
the default config file, the `--check` report, the checks run before loading weights, and an
argparse parser whose errors name the nearest known flag (`ArgumentParser`).

    add_check_args(ap, check_help="... check the model and the port", overrides_help="e.g. port=8001")
    path = config_file(args.config)                    # configs/tiny.yaml when none given and it exists
    problems = [port_problem("127.0.0.1", 8000, "server.port / --port"), model_problem(ref, "server.model")]
    fail_early(problems)                              # ValueError listing them all
    return print_check("serve", cfg, facts=[("address", "http://127.0.0.1:8000")])  # a summary; --json: JSON

Each check returns a message naming the config key, or "" when all is well (`model_problem`,
the model-reference check, is dllm.hub's). `--check-config` skips them (only the command line
and the config: what deploy manifests are validated with on a machine that lacks the
containers' files).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel

from dlrl_config import nearest

DEFAULT_CONFIG = "configs/tiny.yaml"


def config_file(given: str | None, default: str = DEFAULT_CONFIG) -> str | None:
    """`--config` as given, else `default` when that file exists (run from the repository), else None."""
    return given or (default if Path(default).is_file() else None)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with typo help: an unknown `--flag` or an invalid choice names the nearest
    known one (`unrecognized arguments: --chek (did you mean --check?)`), as config keys do."""

    def error(self, message: str) -> NoReturn:
        found = re.match(r"unrecognized arguments: (.*)", message)
        if found:
            flags = [o for a in self._actions for o in a.option_strings]
            hints = [f"{arg}{nearest(arg.split('=', 1)[0], flags)}" for arg in found.group(1).split()]
            if any("did you mean" in h for h in hints):
                message = "unrecognized arguments: " + " ".join(hints)
        super().error(message)


def add_check_args(ap: argparse.ArgumentParser, check_help: str, overrides_help: str) -> None:
    """`--check` (with its help), `--check-config`, `--json` and the positional `key=value` overrides."""
    ap.add_argument("--check", action="store_true", help=check_help)
    ap.add_argument("--check-config", action="store_true", help="only parse the command line and the config")
    add_json_arg(ap)
    ap.add_argument("overrides", nargs="*", help=overrides_help)


def add_json_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true",
                    help="with --check: print the report as JSON, every resolved key included (default: a short "
                         "summary for people)")


Facts = list[tuple[str, str]]  # (what, finding): the --check summary's lines


def print_check(command: str, *sections: Any, facts: Facts | None = None, as_json: bool = False,
                flag: str = "--check") -> int:
    """`dlrl <command> --check` passed: print what it found and return exit code 0 (errors exit 2 before
    this). By default a short summary for people (`facts`, one line each, else a line per section);
    `as_json`: one JSON object with `ok`, `summary` (the same facts) and every resolved section."""
    facts = list(facts or [])
    if as_json:
        out: dict[str, Any] = {"command": command, "ok": True, "summary": dict(facts)}
        for sec in sections:
            out[type(sec).__name__] = sec.model_dump() if isinstance(sec, BaseModel) else str(sec)
        print(json.dumps(out, default=str))
        return 0
    if not facts:
        facts = [(type(sec).__name__, f"{len(sec.model_dump())} keys valid") for sec in sections
                 if isinstance(sec, BaseModel)]
    width = max((len(k) for k, _ in facts), default=0)
    print(f"dlrl {command} {flag}: ok")
    for what, finding in facts:
        print(f"  {what.ljust(width)}  {finding}")
    print("  (--json: this report with every resolved key)")
    return 0


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


def fail_early(problems: list[str]) -> None:
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("\n".join(problems))  # one problem per line
