"""CLI of the dllm package: `dlrl sft` (`dlrl generate` is dllm/generate_cli.py).

    dlrl sft --config configs/tiny.yaml sft.steps=200
"""

from __future__ import annotations

import argparse
import json
import sys

from dlrl_config import ConfigError
from dlrl_config.cli import print_check


def sft_main(argv: list[str]) -> int:
    from dllm.embedded.tiny import load_tiny_sections

    ap = argparse.ArgumentParser(prog="dlrl sft", description="block-diffusion SFT of the embedded default")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--check", action="store_true", help="only parse the command line and the config; exit 0 "
                                                        "(or 2 with the error)")
    ap.add_argument("overrides", nargs="*", help="key=value (e.g. sft.steps=200)")
    args = ap.parse_args(argv)
    try:
        arch, task, sft = load_tiny_sections(args.config, args.overrides, primary="sft")
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    if args.check:
        return print_check("sft", arch, task, sft)
    from pathlib import Path

    from dllm.embedded.sft import SFTStopped, run_sft  # torch: only once there is something to train
    from dllm.embedded.tiny import sft_lock

    try:
        with sft_lock(Path(sft.output_dir)):  # a server or trainer training the same folder: wait (logged)
            metrics = run_sft(arch, task, sft)
    except SFTStopped as e:
        print(f"dlrl sft: {e}", file=sys.stderr)
        return 0
    print(json.dumps(metrics, indent=2))
    return 0
