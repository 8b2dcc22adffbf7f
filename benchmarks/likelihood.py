"""Prompt log-likelihood benchmark: the cost of each likelihood (dllm/likelihood.py), side by side.

    .venv/bin/python benchmarks/likelihood.py            # tiny + ~100M random SDAR, texts of 64 and 256 tokens
    .venv/bin/python benchmarks/likelihood.py --quick    # tiny only, 64 tokens

For each model and text length, a batch of texts is scored by
- `dense`: ONE block-causal forward of the clean texts (what an autoregressive model's
  prompt scoring costs; for reference: it is not a likelihood of a diffusion model),
- `sequential`: the exact sequential-policy likelihood (min(block_size, len) replay rows per
  text, each the noisy + clean copy: 2L positions),
- `naive`: the same numbers computed as the definition says, one dense forward per token (the
  test's reference; first model and length only: it is slow),
- `elbo`: the Monte Carlo ELBO with 4 and 16 samples (one replay row each).
Reported: scored tokens/s, forward rows per text, positions computed per scored token, and the
time relative to `dense`. Random weights, fp32, CPU, best of REPEATS runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllm.config import SDARConfig  # noqa: E402
from dllm.likelihood import elbo_logprobs, sequential_logprobs  # noqa: E402
from dllm.model import SDARForCausalLM  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {  # same shapes as benchmarks/decode.py
    "tiny": dict(vocab_size=100, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "sdar-100M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}
REPEATS = 2
NUM_TEXTS = 4


def build(name: str) -> SDARForCausalLM:
    cfg = SDARConfig(**MODELS[name], block_size=4, mask_token_id=MODELS[name]["vocab_size"] - 1, eos_token_id=0)
    torch.manual_seed(0)
    return SDARForCausalLM(cfg).eval()


def best_time(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def dense(model: SDARForCausalLM, texts: list[list[int]]) -> None:
    ids = torch.tensor(texts)
    model(ids, torch.arange(ids.shape[1]).expand_as(ids))


@torch.no_grad()
def naive(model: SDARForCausalLM, texts: list[list[int]]) -> None:
    bs, mask = model.config.block_size, model.config.mask_token_id
    for ids in texts:
        for p in range(1, len(ids)):
            end = (p // bs + 1) * bs
            state = torch.tensor([ids[:p] + [mask] * (end - p)])
            model(state, torch.arange(end)[None])


def run(name: str, length: int, with_naive: bool) -> list[str]:
    model = build(name)
    vocab, bs = model.config.vocab_size, model.config.block_size
    gen = torch.Generator().manual_seed(1)
    texts = torch.randint(1, vocab - 1, (NUM_TEXTS, length), generator=gen).tolist()
    scored = NUM_TEXTS * (length - 1)
    cases: list[tuple[str, Callable[[], object], int]] = [  # (name, fn, rows of 2L positions per text; 0 = dense)
        ("dense (1 forward, reference)", lambda: dense(model, texts), 0),
        ("sequential (exact)", lambda: sequential_logprobs(model, texts), min(bs, length)),
        ("elbo, 4 samples", lambda: elbo_logprobs(model, texts, 4, seed=0), 4),
        ("elbo, 16 samples", lambda: elbo_logprobs(model, texts, 16, seed=0), 16),
    ]
    if with_naive:
        cases.insert(2, ("naive sequential (1 forward/token)", lambda: naive(model, texts), -1))
    base = 0.0
    lines = []
    for label, fn, rows in cases:
        seconds = best_time(fn)
        base = base or seconds
        if rows == 0:
            per_token, rows_txt = length / (length - 1), "1 (L)"
        elif rows < 0:
            per_token = sum((p // bs + 1) * bs for p in range(1, length)) / (length - 1)
            rows_txt = f"{length - 1} (growing)"
        else:
            per_token, rows_txt = rows * 2 * length / (length - 1), f"{rows} (2L)"
        lines.append(f"| {name} | {length} | {label} | {scored / seconds:,.0f} | {rows_txt} | {per_token:.1f} | "
                     f"{seconds / base:.1f}x |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 64 tokens only")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    print(f"{NUM_TEXTS} texts per batch, block_size 4, fp32 CPU, best of {REPEATS}")
    print("| model | tokens/text | method | scored tokens/s | rows/text | positions per scored token | time vs dense |")
    print("|---|---:|---|---:|---:|---:|---:|")
    plan = [("tiny", 64)] if args.quick else [("tiny", 64), ("tiny", 256), ("sdar-100M", 64), ("sdar-100M", 256)]
    for i, (name, length) in enumerate(plan):
        run(name, length, with_naive=i == 0)


if __name__ == "__main__":
    main()
