"""`dlrl train`: the online RL loop end to end.

    dlrl train --config configs/tiny.yaml                    # embedded default (make train)
    dlrl train --config configs/tiny.yaml num_steps=5 objective=dipo servers=http://h1:8000,http://h2:8000
    dlrl train --config configs/tiny.yaml --resume

If no server answers at `train.servers` it starts one; if no SFT model exists yet it
trains it first. Writes metrics.jsonl, TensorBoard logs, curves.png and a final
Hugging Face export (SDAR layout) under `train.output_dir`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dllm.configlib import ConfigError, check_overrides, load_section

log = logging.getLogger("dlrl.train")


def main(argv: list[str]) -> int:
    from dllm.sft import SFTConfig, TinyModelConfig
    from dllm.task import ArithmeticTask
    from trainer.config import TrainConfig

    ap = argparse.ArgumentParser(prog="dlrl train", description="online RL for block-diffusion LMs")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--resume", action="store_true", help="continue from output_dir/checkpoint")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (e.g. num_steps=5)")
    args = ap.parse_args(argv)
    overrides = list(args.overrides) + (["train.resume=true"] if args.resume else [])
    try:
        sections = {"train": TrainConfig, "model": TinyModelConfig, "task": ArithmeticTask, "sft": SFTConfig}
        check_overrides([o for o in overrides if not o.startswith("server.")], sections, primary="train")
        cfg = load_section(TrainConfig, args.config, "train", overrides)
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    from rollout_client.client import RolloutError
    from trainer.context import RunContext
    from weight_sync import WeightSyncError

    ctx = RunContext(cfg, args.config, overrides)
    try:
        return _run(ctx, cfg)
    except (RuntimeError, ValueError, FileNotFoundError, WeightSyncError, RolloutError) as e:
        log.error("training stopped: %s", e)
        print(f"dlrl train: error: {e}", file=sys.stderr)
        return 1
    finally:
        ctx.close()


def _run(ctx, cfg) -> int:
    from trainer.loop import train_loop

    ctx.setup()
    log.info("training %s on %s from version %d (%s, %s)", ctx.model_dir, ", ".join(cfg.servers),
             ctx.version, cfg.objective, cfg.mode)
    if cfg.eval_every and ctx.start_step == 0:
        acc = ctx.evaluate()
        ctx.logger.log(0, {"version": ctx.version, "eval_accuracy": acc})
        log.info("step 0: held-out greedy accuracy %.1f%%", 100 * acc)
    last = train_loop(ctx)
    final = ctx.export()
    png = ctx.finish()
    summary = {"final_model": str(final), "curves": str(png), "version": ctx.version,
               "eval_accuracy": last.get("eval_accuracy")}
    print(json.dumps(summary, indent=2))
    return 0
