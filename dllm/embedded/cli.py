"""CLI of the dllm package: `dlrl sft` (`dlrl generate` is dllm/generate_cli.py).

    dlrl sft --config configs/tiny.yaml sft.steps=200
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dlrl_config import ConfigError
from dlrl_config.cli import ArgumentParser, add_json_arg, print_check


def sft_main(argv: list[str]) -> int:
    from dllm.embedded.tiny import load_tiny_sections

    ap = ArgumentParser(prog="dlrl sft", description="block-diffusion SFT of the embedded default")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--check", action="store_true", help="only parse the command line and the config; exit 0 "
                                                        "(or 2 with the error)")
    add_json_arg(ap)
    ap.add_argument("overrides", nargs="*", help="key=value (e.g. sft.steps=200)")
    args = ap.parse_intermixed_args(argv)  # key=value overrides before and after flags
    try:
        arch, task, sft = load_tiny_sections(args.config, args.overrides, primary="sft")
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    if args.check:
        return print_check("sft", arch, task, sft, as_json=args.json, facts=[
            ("model", f"{arch.family}, {arch.num_hidden_layers} layers of {arch.hidden_size}, block size {arch.block_size}"),
            ("task", f"{task.min_digits}-{task.max_digits} digit addition" + (", fixed width (37+85= -> 122, 12+34= -> 046)"
                                                                            if task.fixed_width else "")),
            ("sft", f"{sft.steps} steps of {sft.batch_size} into {sft.output_dir}"
                    + (" (replacing the model there)" if Path(sft.output_dir, "config.json").is_file() else ""))])
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
