"""Host overhead of one engine step: before (1cd46a0, the branch point of issue 43) vs after, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/host_overhead.py                     # batches 1, 32, 128
    PYTHONPATH=. .venv/bin/python benchmarks/host_overhead.py --batches 1 4 --steps 10 --rounds 1   # dry run

On a 1-layer, width-16 model the step is all host work and op dispatch, so what the step costs beyond
the model's forward is what the engine adds. `batch` sequences decode together (prompt 4 tokens, EOS
ignored, max_tokens large enough that none ends), eager (server.compile's default), one thread:
- before: dllm at 1cd46a0 (benchmarks/oldref.load_package: the same torch, in this process), its
  `BlockDecoder.step(running)` (the step, post-processing, its own slot and page pool);
- after: `dllm.decoding.Decoder.step()` -- the scheduler's schedule (block manager), the runner's
  typed step, the scheduler's post-processing: the loop the server's engine runs.
Per step: its time, the model's forward inside it (`model.hidden_states`, the layers, timed by a
wrapper), and the rest (inputs, sampling and commit, the copies, the scheduler and post-processing),
in process CPU time (one thread: the engine's own work, whatever else the box runs) and in wall time.
Before and after alternate `--rounds` times after a warm-up; the median of each is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.oldref import load_package  # noqa: E402
from dllm.config import SDARConfig  # noqa: E402
from dllm.decoding import Decoder  # noqa: E402
from dllm.model import SDARForCausalLM  # noqa: E402
from dllm.runner import BlockRunner  # noqa: E402
from dllm.sampling import SamplingParams  # noqa: E402

BEFORE = "1cd46a0"
CFG = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
           num_key_value_heads=1, head_dim=8, block_size=4, mask_token_id=63, eos_token_id=0)


class Timed:
    """Wraps a model's `hidden_states` (the layers) and sums the wall and CPU time spent in it."""

    def __init__(self, model: Any) -> None:
        self.wall = self.cpu = 0.0
        self.inner = model.hidden_states
        model.hidden_states = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.inner(*args, **kwargs)
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        return out


def params(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True)  # dynamic, threshold 0.9: the default


def after(model: SDARForCausalLM, batch: int, max_len: int) -> Callable[[], None]:
    dec = Decoder(BlockRunner(model, max_batch=batch, max_len=max_len, eos_ids=[0]))
    dec.add([dec.runner.new_sequence([1, 2, 3, 4], params(i, max_len - 8)) for i in range(batch)])
    return lambda: dec.step() and None


def before(old: Any, model: Any, batch: int, max_len: int) -> Callable[[], None]:
    dec = old.decoding.BlockDecoder(model, max_batch=batch, max_len=max_len, eos_ids=[0])
    seqs = [dec.new_sequence([1, 2, 3, 4], old.sampling.SamplingParams(**vars(params(i, max_len - 8))))
            for i in range(batch)]
    dec.add(seqs)
    return lambda: dec.step(seqs) and None


def measure(step: Callable[[], None], timed: Timed, warmup: int, steps: int) -> dict[str, float]:
    """ms per step, CPU and wall, of the step and of the forward inside it, over `steps` steps after `warmup`."""
    for _ in range(warmup):
        step()
    timed.wall = timed.cpu = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    k = 1e3 / steps
    return {"step_cpu": k * (time.process_time() - c0), "step_wall": k * (time.perf_counter() - t0),
            "forward_cpu": k * timed.cpu, "forward_wall": k * timed.wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    new_model = SDARForCausalLM(SDARConfig(**CFG)).eval()
    old = load_package("dllm", BEFORE)
    old_model = old.model.SDARForCausalLM(old.config.SDARConfig.from_dict(new_model.config.to_dict())).eval()
    old_model.load_state_dict(dict(new_model.hf_named_tensors()), strict=False)
    timers = {"before": Timed(old_model), "after": Timed(new_model)}
    max_len = 4 * (args.warmup + args.steps) + 16  # one token a step at worst: none ends
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for _ in range(args.rounds):
                for name in ("before", "after"):
                    step = (before(old, old_model, batch, max_len) if name == "before"
                            else after(new_model, batch, max_len))
                    got[name].append(measure(step, timers[name], args.warmup, args.steps))
            row: dict[str, Any] = {"batch": batch}
            for name, runs in got.items():
                row[name] = med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                med["outside_cpu"], med["outside_wall"] = (med["step_cpu"] - med["forward_cpu"],
                                                           med["step_wall"] - med["forward_wall"])
            rows.append(row)
    print(f"1 layer, width 16, block 4, eager, 1 thread; median of {args.rounds} alternating rounds of "
          f"{args.steps} steps")
    for clock in ("cpu", "wall"):
        print(f"\n{'process CPU' if clock == 'cpu' else 'wall'} ms per step\n")
        print("| batch | step before | step after | forward before | forward after | outside before | "
              "outside after | after / before (step) | after / before (outside) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            b, a = r["before"], r["after"]
            print(f"| {r['batch']} | {b['step_' + clock]:.2f} | {a['step_' + clock]:.2f} | "
                  f"{b['forward_' + clock]:.2f} | {a['forward_' + clock]:.2f} | {b['outside_' + clock]:.2f} | "
                  f"{a['outside_' + clock]:.2f} | {a['step_' + clock] / b['step_' + clock]:.2f} | "
                  f"{a['outside_' + clock] / b['outside_' + clock]:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
