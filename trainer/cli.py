"""`dlrl train`: the online RL loop end to end, on one rank or many.

    dlrl train --config configs/tiny.yaml                    # embedded default (make train)
    dlrl train --config configs/tiny.yaml num_steps=5 objective=dipo servers=http://h1:8000,http://h2:8000
    dlrl train --config configs/tiny.yaml nproc=2            # 2 local ranks (torchrun)
    torchrun --nproc_per_node 8 -m dlrl.cli train --config cfg.yaml       # under any launcher
    deepspeed --num_gpus 8 --module dlrl.cli train --config cfg.yaml
    dlrl train --config configs/tiny.yaml --resume

If no server answers at `train.servers` (local addresses) rank 0 starts one; if no SFT model
exists yet it trains it first. Rank 0 writes metrics.jsonl, TensorBoard logs, curves.png and
the final Hugging Face export (SDAR layout) under `train.output_dir`. SIGTERM / SIGINT: the
push in flight is aborted, a checkpoint is saved, servers the trainer started are stopped,
exit code 0 (`--resume` continues); a second signal stops at once.

The trainer's modules, for a newcomer: this file is the command (arguments, signals, errors, the
`nproc=N` local launch); trainer/run.py is what one run is made of (Run, built once by build_run);
trainer/loop.py is what a run does, step by step (rl_step, train_loop).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from dllm.embedded.sft_config import SFTStopped  # torch-free: --help and --check stay light
from dllm.embedded.tiny import TINY_SECTIONS
from dlrl_config import ConfigError, load_sections
from dlrl_config.cli import ArgumentParser, add_check_args, print_check
from trainer.config import ServerKeys, TrainConfig
from trainer.monitor.metrics_log import read_jsonl

if TYPE_CHECKING:  # torch, deepspeed: imported once the command runs (--help and --check never import them)
    from trainer.infra.publish import Publisher
    from trainer.run import Run

log = logging.getLogger("dlrl.train")


class Interrupted(KeyboardInterrupt):
    """A second SIGTERM / SIGINT: stop now (main() answers it with one line, no traceback)."""

    def __init__(self, signum: int):
        super().__init__(f"second {signal.Signals(signum).name}: stopped now, this step not saved")
        self.signum = signum


class Stopper:
    """SIGTERM / SIGINT handler: ask the loop to stop at the next step boundary; a push in
    flight on rank 0 is aborted at once. A second signal interrupts immediately (Interrupted).
    The first-start SFT of the embedded default handles both itself (dllm.embedded.sft)."""

    def __init__(self) -> None:
        self.requested = False
        self.publisher: Publisher | None = None

    def install(self) -> Stopper:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def uninstall(self) -> None:
        """Give the process its previous handlers back (main() may run inside another program)."""
        for sig, handler in getattr(self, "_previous", {}).items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.requested:
            raise Interrupted(signum)
        self.requested = True
        log.warning("%s: stopping at the end of this step (checkpoint, stop servers, exit 0)",
                    signal.Signals(signum).name)
        if self.publisher is not None and self.publisher.pushing:
            from trainer.loop import StopRequested

            raise StopRequested(f"{signal.Signals(signum).name} during a push: aborting it")


def parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any], list[str]]:
    """-> (args, root sections, overrides): the config file read once, every section typed."""
    ap = ArgumentParser(prog="dlrl train", description="online RL for block-diffusion LMs")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--resume", action="store_true", help="continue from output_dir/checkpoint")
    add_check_args(ap, check_help="parse the command line and the config and check data files, the reward import, "
                   "the model, the servers' ports and admin token; exit 0 (or 2 with the errors)",
                   overrides_help="key=value overrides (e.g. num_steps=5 nproc=2)")
    args = ap.parse_intermixed_args(argv)  # key=value overrides before and after flags
    overrides = list(args.overrides) + (["train.resume=true"] if args.resume else [])
    try:
        root = load_sections(args.config, overrides, {"train": TrainConfig, **TINY_SECTIONS, "server": ServerKeys},
                             primary="train")
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    return args, root, overrides


def main(argv: list[str]) -> int:
    args, root, overrides = parse(argv)
    cfg = root["train"]
    if args.check_config:
        return print_check("train", cfg, as_json=args.json, flag="--check-config")
    facts: list[tuple[str, str]] = []
    if os.environ.get("RANK", "0") == "0":  # before loading anything (other ranks wait for rank 0's errors)
        from trainer.preflight import train_report

        problems, facts = train_report(cfg, root, args.config, overrides)
        if problems:
            print("\n".join(f"dlrl train: error: {p}" for p in problems), file=sys.stderr)  # one problem per line
            return 2
    if args.check:
        return print_check("train", cfg, facts=facts, as_json=args.json)
    return _run(cfg, root, args, argv, overrides)


def _run(cfg: TrainConfig, root: dict[str, Any], args: argparse.Namespace, argv: list[str],
         overrides: list[str]) -> int:
    """The command itself, past the checks: torch and DeepSpeed are imported from here on."""
    main_rank, t0 = os.environ.get("RANK", "0") == "0", time.monotonic()
    if main_rank:
        log.info("checks passed; loading torch and DeepSpeed (a few seconds on an idle box, minutes on a "
                 "heavily loaded one)")
    from trainer.extensions import ensure_extensions_dir

    ensure_extensions_dir()  # DeepSpeed's op cache, also for the ranks started below (issue 38)
    from rollout_client.client import AdminError, RolloutError
    from trainer.infra.dist import RankError, select_device
    from trainer.infra.fleet import FleetError
    from trainer.loop import StopRequested
    from trainer.run import build_run
    from weight_sync import WeightSyncError

    if main_rank:
        log.info("torch and DeepSpeed loaded in %.0f s; setting up the run (process group, model, servers)",
                 time.monotonic() - t0)

    try:
        select_device(cfg.device)  # before any rank starts: torchrun's ranks inherit it
    except ValueError as e:
        print(f"dlrl train: {e}", file=sys.stderr)
        return 2
    if cfg.nproc > 1 and not under_launcher():
        return launch_local(cfg.nproc, argv)
    stopper = Stopper().install()
    run = None
    try:
        run = build_run(root, args.config, overrides)
        stopper.publisher = run.publisher
        return _train(run, cfg, stopper)
    except StopRequested as e:
        log.warning("%s: checkpoint saved; continue with --resume", e)
        return 0
    except SFTStopped as e:  # a signal during the first-start SFT of the embedded default
        print(f"dlrl train: {e}", file=sys.stderr, flush=True)
        return 0
    except Interrupted as e:
        print(f"dlrl train: {e}; {_how_to_go_on(cfg)}", file=sys.stderr, flush=True)
        return 128 + e.signum
    except (RuntimeError, ValueError, FileNotFoundError, WeightSyncError, RolloutError, AdminError, FleetError,
            RankError) as e:
        log.error("training stopped: %s", e)
        print(f"dlrl train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if run is not None:
            run.close()
        stopper.uninstall()


def _how_to_go_on(cfg: TrainConfig) -> str:
    """After a stop that saved nothing: --resume only when a checkpoint is there to continue."""
    from trainer.infra.guards import resume_state

    state = resume_state(cfg.replace(resume=True))
    if state.step is not None and not state.problem:
        return f"continue from the last checkpoint (step {state.step}) with --resume"
    return f"nothing to --resume ({state.problem.removeprefix('--resume: ')})"


def _train(run: Run, cfg: TrainConfig, stopper: Stopper) -> int:
    from trainer.loop import train_loop

    t0 = time.monotonic()
    if run.ranks.is_main:
        log.info("training %s on %s from version %d (%s, %s, %d rank(s), ZeRO-%d)", run.model_dir,
                 ", ".join(cfg.servers), run.version, cfg.objective, cfg.mode, run.ranks.world_size, cfg.zero_stage)
    if cfg.eval_every and run.start_step == 0:
        scores = run.evaluate()
        if scores is not None:
            run.log(0, {"version": run.version, **scores})
    last = train_loop(run, should_stop=lambda: stopper.requested)
    final = run.export()
    png = run.finish()
    if run.ranks.is_main:
        line = summary_line(run.out, cfg.num_steps - run.start_step, time.monotonic() - t0)
        print(line, flush=True)  # for people; the JSON after it for programs (stdout from its "{" on)
        summary = {"final_model": str(final), "curves": str(png), "version": run.version,
                   "eval_accuracy": last.get("eval_accuracy"), "num_ranks": run.ranks.world_size, "summary": line}
        print(json.dumps(summary, indent=2))
    return 0


def under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch_local(nproc: int, argv: list[str]) -> int:
    """`dlrl train nproc=N`: run `dlrl train <argv>` as `nproc` local ranks with torch's own elastic
    agent (`torch.distributed.run --standalone`: a rank that fails stops the others; SIGTERM /
    SIGINT are forwarded to the ranks, which checkpoint and exit 0); returns the job's exit code.
    Under a launcher (torchrun, the DeepSpeed launcher, a Kubernetes indexed Job or Slurm setting
    RANK / WORLD_SIZE) `nproc` is not used: the launcher already started the ranks."""
    argv = [a for a in argv if a.split("=", 1)[0].removeprefix("train.") != "nproc"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dlrl.cli", "train", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log.info("starting %d local ranks: %s", nproc, " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def summary_line(out: Path, steps: int, seconds: float) -> str:
    """`done: held-out greedy accuracy 31.5% -> 84.5% over 60 steps in 2 min 40 s; outputs in ...`
    (the first and last evaluations of output_dir/metrics.jsonl)."""
    evals = [r["eval_accuracy"] for r in read_jsonl(out / "metrics.jsonl") if "eval_accuracy" in r]
    acc = (f"held-out greedy accuracy {100 * evals[0]:.1f}% -> {100 * evals[-1]:.1f}%" if evals
           else "no held-out evaluation (train.eval_every=0)")
    wall = f"{int(seconds // 60)} min {int(seconds % 60)} s" if seconds >= 60 else f"{seconds:.1f} s"
    made = [n for n in ("metrics.jsonl", "curves.png", "final", "tb", "checkpoint") if (out / n).exists()]
    return f"done: {acc} over {steps} steps in {wall}; outputs in {out}/ ({', '.join(made)})"
