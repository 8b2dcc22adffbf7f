"""The `dlrl` command: dispatches to each package's CLI, importing it lazily.

    dlrl sft      --config configs/tiny.yaml [key=value ...]   train the embedded default
    dlrl generate --model DIR --prompt TEXT [--trace]          print completions
    dlrl serve    --config configs/tiny.yaml [--host H --port P key=value ...]
    dlrl train    --config configs/tiny.yaml [nproc=N] [key=value ...]
    dlrl eval     --config configs/tiny.yaml [data=math500.jsonl num_samples=4 ...]
    dlrl align    --config configs/align.yaml [key=value ...]        continuous alignment (make align)
    dlrl versions --store runs/feedback.db [--events] [--rollback V]  the version registry
"""

from __future__ import annotations

import logging
import os
import sys

COMMANDS = {
    "sft": ("dllm.cli", "sft_main"),
    "generate": ("dllm.cli", "generate_main"),
    "serve": ("server.cli", "main"),
    "train": ("trainer.cli", "main"),
    "eval": ("trainer.eval_cli", "main"),
    "align": ("trainer.align_cli", "main"),
    "versions": ("trainer.align_cli", "versions_main"),
}

PREFLIGHT_COMMANDS = ("serve", "train", "eval")  # --check also checks files, imports, ports, tokens


def _strip_local_rank(argv: list[str]) -> list[str]:
    """The DeepSpeed launcher adds `--local_rank=N` (before the command): LOCAL_RANK carries it."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name, _, value = a.partition("=")
        if name in ("--local_rank", "--local-rank"):
            if not value and i + 1 < len(argv):
                value, skip = argv[i + 1], True
            os.environ.setdefault("LOCAL_RANK", value)
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _strip_local_rank(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ndlrl: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if argv[0] not in PREFLIGHT_COMMANDS:  # their --check is the config check
        argv = [("--check" if a == "--check-config" else a) for a in argv]
    module, func = COMMANDS[argv[0]]
    import importlib

    return importlib.import_module(module).__dict__[func](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
