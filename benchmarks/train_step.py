"""Replay training step (forward + backward of the learner's loss path), old model vs today's, side by side.

    .venv/bin/python benchmarks/train_step.py                     # old = OLD_REF, new eager, new compiled
    .venv/bin/python benchmarks/train_step.py --shape tiny --no-compile

One step is what `trainer.rl.learner.Learner` runs per micro-batch: the noisy-copy + clean-copy
forward to hidden states (`model(..., output="hidden")`), the chunked vocabulary projection
of the scored tokens (`trainer.rl.replay.chunked_token_logprobs`, `logprob_chunk` tokens of
full-vocabulary logits at a time) and the backward of a policy-gradient-shaped loss. Rows
are random replay rows (a block-diffusion mask on ~40% of the tokens). Reported per
variant: ms per step (median of interleaved rounds, all variants in one process), tokens/s
(rows x length of the noisy copy), aten ops of one forward + backward (profiler, nested
ones included) and the bytes of the largest full-vocabulary logits tensor the loss builds
(chunked vs all scored tokens at once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
OLD_REF = "2bdf442"
SHAPES = {  # the embedded default, a wider layer stack, and a small model with the SDAR vocabulary
    "tiny": dict(vocab_size=101, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "medium": dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "small": dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}


def make_rows(vocab: int, rows: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(2, vocab - 1, (rows, length), generator=g)
    target = torch.rand(rows, length, generator=g) < 0.4
    noisy = torch.where(target, torch.full_like(clean, vocab - 1), clean)
    pos = torch.arange(length).expand(rows, length)
    return noisy, clean, pos, torch.ones(rows, length, dtype=torch.bool), target


def step(model, batch, chunk: int) -> None:
    from trainer.rl.replay import chunked_token_logprobs

    noisy, clean, pos, valid, target = batch
    hidden = model(noisy, position_ids=pos, clean_ids=clean, valid=valid, output="hidden")  # [R, L, D]
    lp, _, anchor = chunked_token_logprobs(model.lm_head, hidden[target], clean[target], model.config.mask_token_id,
                                           chunk=chunk)
    (-(lp * 0.5).mean() + anchor).backward()  # the shape of a policy-gradient loss
    model.zero_grad(set_to_none=True)


def count_ops(model, batch, chunk: int) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, batch, chunk)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def build(pkg, shape: dict, seed: int = 0):
    cfg = pkg.config.SDARConfig(block_size=4, mask_token_id=shape["vocab_size"] - 1, eos_token_id=0, **shape)
    torch.manual_seed(seed)
    return pkg.model.SDARForCausalLM(cfg).train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default=OLD_REF)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024, help="train.logprob_chunk (0: all scored tokens at once)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared box makes spinning OpenMP threads slow)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from oldref import load_package

    import dllm
    import dllm.config
    import dllm.model

    shape = SHAPES[args.shape]
    batch = make_rows(shape["vocab_size"], args.rows, args.length)
    variants = {"old eager": build(load_package("dllm", args.ref), shape), "new eager": build(dllm, shape)}
    if not args.no_compile:
        compiled = build(dllm, shape)
        t0 = time.perf_counter()
        compiled.compile_layers()
        step(compiled, batch, args.chunk)
        print(f"compile (first step, forward + backward): {time.perf_counter() - t0:.1f}s")
        variants["new compiled"] = compiled
    ops = {name: count_ops(m, batch, args.chunk) if name != "new compiled" else None for name, m in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for m in variants.values():
        step(m, batch, args.chunk)  # warm-up
    for _ in range(args.rounds):  # interleaved: a loaded box slows every variant alike
        for name, m in variants.items():
            t0 = time.perf_counter()
            step(m, batch, args.chunk)
            times[name].append(time.perf_counter() - t0)
    n_scored = int(batch[4].sum())
    logits_chunked = min(args.chunk or n_scored, n_scored) * shape["vocab_size"] * 4
    print(f"replay step, shape {args.shape} ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"vocab {shape['vocab_size']}), {args.rows} rows x {args.length} tokens, {n_scored} scored, "
          f"{args.threads} threads; old = {args.ref}")
    print(f"largest logits tensor: {logits_chunked / 2**20:.1f} MiB with logprob_chunk={args.chunk} "
          f"(all {n_scored} scored at once: {n_scored * shape['vocab_size'] * 4 / 2**20:.1f} MiB; "
          f"every token of the layout: {2 * args.rows * args.length * shape['vocab_size'] * 4 / 2**20:.1f} MiB)")
    base = statistics.median(times["old eager"])
    print(f"{'variant':14s} {'ms/step':>9s} {'tok/s':>9s} {'speed-up':>9s} {'aten ops':>9s}")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"{name:14s} {ms * 1e3:9.1f} {args.rows * args.length / ms:9.0f} {base / ms:9.2f} "
              f"{ops[name] if ops[name] is not None else '-':>9}")


if __name__ == "__main__":
    main()
