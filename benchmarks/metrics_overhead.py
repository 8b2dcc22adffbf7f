"""Cost of the server's Prometheus metrics (issue 25): engine throughput with and without them, same run.

    .venv/bin/python benchmarks/metrics_overhead.py                  # tiny model, batch 32, 3 rounds
    .venv/bin/python benchmarks/metrics_overhead.py --batch 64 --max-tokens 64 --rounds 5

One Engine (native backend, CPU) decodes `--batch` sequences of `--max-tokens` tokens (ignore_eos)
per round, alternately with ServerMetrics bound (its step listener: per-sequence TTFT, inter-token,
e2e, queue time, histograms) and without any listener. Reports the best round of each, the ratio,
and the time spent inside the listener per engine step (measured around each call).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_round(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from dllm.sampling import SamplingParams

    async def go() -> None:
        seqs = engine.make_sequences(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                             strategy="static", temperature=1.0, seed=0))
        await engine.wait(engine.submit(seqs))

    steps0, t0 = engine.num_steps, time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - t0, engine.num_steps - steps0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    from benchmarks.serve import model_dir
    from server.engine.backends.native import NativeBackend
    from server.engine.engine import Engine
    from server.metrics import ServerMetrics

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, desc = model_dir("tiny", Path(tmp))
        backend = NativeBackend.from_pretrained(path, device="cpu", dtype="float32", max_batch=args.batch,
                                                max_model_len=256)
        engine = Engine(backend, max_queue=4 * args.batch).start()
        metrics = ServerMetrics()
        listener_s = [0.0]

        def timed(stats) -> None:
            t = time.perf_counter()
            metrics.observe_step(stats)
            listener_s[0] += time.perf_counter() - t

        prompts = [[5 + i % 7, 6, 7, 8, 9] for i in range(args.batch)]
        run_round(engine, prompts, args.max_tokens)  # warm-up
        best = {"off": float("inf"), "on": float("inf")}
        steps = {"off": 0, "on": 0}
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                engine._listeners = [timed] if mode == "on" else []
                if mode == "on":
                    metrics.engine = engine
                listener_s[0] = 0.0
                seconds, num = run_round(engine, prompts, args.max_tokens)
                if seconds < best[mode]:
                    best[mode], steps[mode] = seconds, num
                    if mode == "on":
                        per_step = listener_s[0] / max(num, 1)
        engine.shutdown()
    toks = args.batch * args.max_tokens
    print(f"model: {desc}; batch {args.batch} x {args.max_tokens} tokens, best of {args.rounds} rounds, CPU")
    for mode in ("off", "on"):
        print(f"metrics {mode:3}: {best[mode]:.3f} s, {steps[mode]} steps, {toks / best[mode]:.0f} tokens/s")
    print(f"with / without metrics: {best['on'] / best['off']:.3f}x wall time; listener {1e6 * per_step:.0f} us "
          f"per step ({100 * per_step * steps['on'] / best['on']:.2f}% of the wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
