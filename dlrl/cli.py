"""The `dlrl` command: dispatches to each package's CLI, importing it lazily.

    dlrl sft      --config configs/tiny.yaml [key=value ...]   train the embedded default
    dlrl generate model=DIR prompt=TEXT [max_tokens=64 trace=true ...]  print completions
    dlrl serve    --config configs/tiny.yaml [server.port=P key=value ...]
    dlrl train    --config configs/tiny.yaml [nproc=N] [key=value ...]
    dlrl eval     --config configs/tiny.yaml [data=math500.jsonl num_samples=4 ...]
    dlrl align    --config configs/align.yaml [key=value ...]        continuous alignment (make align)
    dlrl versions store=runs/feedback.db [--events] [--rollback V]  the version registry
    dlrl config show [--command train] [--config FILE] [key=value ...]  the resolved config as YAML

`dlrl <command> --help` lists every config key of the command (type, default, help);
`--check` validates a command line, its config, files, imports, ports and tokens without running;
`--check-config` only the command line and the config. Options are `key=value` overrides
everywhere; the older `--max-tokens`-style flags (`dlrl generate`), `--host`/`--port`/`--model`
(`dlrl serve`) and `--store` (`dlrl versions`) are aliases of config keys.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlrl_config import Config

COMMANDS = {
    "sft": ("dllm.embedded.cli", "sft_main"),
    "generate": ("dllm.generate_cli", "generate_main"),
    "serve": ("server.cli", "main"),
    "train": ("trainer.cli", "main"),
    "eval": ("trainer.eval_cli", "main"),
    "align": ("trainer.align.cli", "main"),
    "versions": ("trainer.align.cli", "versions_main"),
}

PREFLIGHT_COMMANDS = ("serve", "train", "eval")  # --check also checks files, imports, ports, tokens
SECTION_CLASSES = {
    "model": "dllm.embedded.sft_config:TinyModelConfig", "task": "dllm.embedded.task:ArithmeticTask",
    "sft": "dllm.embedded.sft_config:SFTConfig",
    "server": "server.config:ServerConfig", "train": "trainer.config:TrainConfig",
    "eval": "trainer.eval_cli:EvalConfig", "align": "trainer.align.config:AlignConfig",
    "users": "trainer.align.config:UsersConfig", "generate": "dllm.generate_cli:GenerateConfig"}
COMMAND_SECTIONS = {  # command -> (its own section: bare key=value overrides, the sections it reads)
    "sft": ("sft", ["sft", "model", "task"]),
    "serve": ("server", ["server", "model", "task", "sft"]),
    "train": ("train", ["train", "model", "task", "sft", "server"]),
    "eval": ("eval", ["eval", "task", "server"]),
    "align": ("align", ["align", "users", "train", "model", "task", "sft", "server"]),
    "generate": ("generate", ["generate"]),
    "versions": ("align", ["align"]),  # store, serving replicas, admin token (server.* fallbacks)
}


def _section_class(name: str) -> type[Config]:
    import importlib

    module, attr = SECTION_CLASSES[name].split(":")
    return getattr(importlib.import_module(module), attr)


def print_keys(command: str) -> None:
    """Every config key the command reads: `section.key  TYPE = DEFAULT  # help`."""
    from dlrl_config.describe import describe

    primary, names = COMMAND_SECTIONS[command]
    print(f"\nconfig keys (YAML section.key, or key=value / section.key=value on the command line; bare keys "
          f"are {primary}.*):")
    for name in names:
        cls = _section_class(name)
        doc = (cls.__doc__ or "").strip().splitlines()
        print(f"\n[{name}] {doc[0] if doc else ''}".rstrip())
        print("\n".join(describe(cls, name)))


def config_main(argv: list[str]) -> int:
    """`dlrl config show [--command C] [--config FILE] [key=value ...]`: the resolved config as YAML."""

    from dlrl_config import ConfigError, load_sections
    from dlrl_config.cli import ArgumentParser, config_file
    from dlrl_config.describe import dump_yaml

    ap = ArgumentParser(prog="dlrl config", description="print the resolved config as YAML")
    ap.add_argument("action", choices=["show"])
    ap.add_argument("--command", choices=sorted(COMMAND_SECTIONS), default=None,
                    help="only the sections this command reads (bare key=value overrides are its own section's)")
    ap.add_argument("--config", default=None, help="YAML config (default configs/tiny.yaml when it exists)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = ap.parse_intermixed_args(argv)
    path = config_file(args.config)
    primary, names = COMMAND_SECTIONS[args.command] if args.command else (None, list(SECTION_CLASSES))
    try:
        sections = load_sections(path, args.overrides, {n: _section_class(n) for n in names},
                                 primary=primary or "")
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    print(f"# resolved config{f' of dlrl {args.command}' if args.command else ''} (from {path or 'defaults'})")
    print(dump_yaml(sections), end="")
    return 0


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
    if argv and argv[0] == "config":
        return config_main(argv[1:])
    if argv and argv[0] in COMMAND_SECTIONS and any(a in ("-h", "--help") for a in argv[1:]):
        import importlib

        module, func = COMMANDS[argv[0]]
        try:
            importlib.import_module(module).__dict__[func](["--help"])
        except SystemExit:
            pass
        print_keys(argv[0])
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            from dlrl_config import nearest

            print(f"\ndlrl: error: unknown command {argv[0]!r}{nearest(argv[0], [*COMMANDS, 'config'])}",
                  file=sys.stderr)
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
