"""Decoding benchmark: KV cache vs no-cache baseline, static vs dynamic tokens per forward.

    .venv/bin/python benchmarks/decode.py            # tiny + ~100M random SDAR, batch 1/8/32
    .venv/bin/python benchmarks/decode.py --quick    # smaller run

For each model and batch size: tokens/s with the KV cache and with a baseline that
recomputes the whole prefix every forward (same sampling, same seeds, same tokens), and
the speed-up. Then tokens per denoising forward for static (1 token/step) vs dynamic
(confidence threshold) decoding on the SFT tiny model if present (trained weights make
the threshold meaningful), else on random weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllm.config import SDARConfig  # noqa: E402
from dllm.decoding import BlockDecoder  # noqa: E402
from dllm.model import SDARForCausalLM  # noqa: E402
from dllm.sampling import SamplingParams  # noqa: E402

MODELS = {
    "tiny-1M": dict(vocab_size=101, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "sdar-100M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}


def build(name: str) -> SDARForCausalLM:
    cfg = SDARConfig(**MODELS[name], block_size=4, mask_token_id=MODELS[name]["vocab_size"] - 1, eos_token_id=0)
    torch.manual_seed(0)
    return SDARForCausalLM(cfg).eval()


def run(model, batch: int, prompt_len: int, max_tokens: int, use_cache: bool, params: SamplingParams):
    """-> (tokens generated, seconds, denoising forwards)."""
    dec = BlockDecoder(model, max_batch=batch, max_len=prompt_len + max_tokens + 4, eos_ids=[], use_cache=use_cache)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size - 1, (prompt_len,), generator=g).tolist()
               for _ in range(batch)]
    seqs = [dec.new_sequence(p, params) for p in prompts]
    t0 = time.perf_counter()
    dec.add(seqs)
    running = list(seqs)
    while running:
        dec.step(running)
        running = [s for s in running if not s.is_finished]
    return sum(len(s.completion_ids) for s in seqs), time.perf_counter() - t0, dec.num_forwards


def cache_table(names, batches, prompt_len, max_tokens):
    print(f"\n## KV cache vs recompute-prefix baseline (prompt {prompt_len}, {max_tokens} new tokens, "
          "static 1 token/forward, greedy)")
    print("| model | batch | cache tok/s | no-cache tok/s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, strategy="static", ignore_eos=True)
    for name in names:
        model = build(name)
        run(model, 1, 8, max_tokens, True, params)  # warm-up
        for b in batches:
            n1, s1, _ = run(model, b, prompt_len, max_tokens, True, params)
            n2, s2, _ = run(model, b, prompt_len, max_tokens, False, params)
            print(f"| {name} | {b} | {n1 / s1:,.0f} | {n2 / s2:,.0f} | {s2 / s1:.2f}x |", flush=True)


def tpf_table(max_tokens):
    sft = Path("runs/tiny-sft")
    if (sft / "config.json").is_file():
        from dllm.task import ArithmeticTask
        from dllm.tokenizer import encode, load_tokenizer
        from dllm.weights import load_pretrained
        model, tok = load_pretrained(sft), load_tokenizer(sft)
        prompts = [encode(tok, e["prompt"]) for e in ArithmeticTask().split("heldout", 64)]
        label = "tiny SFT (runs/tiny-sft), held-out prompts"
    else:
        model = build("tiny-1M")
        prompts = [[1 + i % 50] * 6 for i in range(64)]
        label = "tiny random weights"
    print(f"\n## Tokens per denoising forward ({label}, batch 64, max {max_tokens} tokens)")
    print("| strategy | tokens | forwards | tokens/forward |")
    print("|---|---:|---:|---:|")
    for strategy, kw in [("static", {}), ("static steps=2", {"steps": 2}), ("dynamic thr=0.9", {"threshold": 0.9}),
                         ("dynamic thr=0.7", {"threshold": 0.7})]:
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, strategy=strategy.split()[0], **kw)
        dec = BlockDecoder(model, max_batch=len(prompts), max_len=64, tokenizer=None)
        seqs = [dec.new_sequence(x, p) for x in prompts]
        dec.add(seqs)
        running = list(seqs)
        while running:
            dec.step(running)
            running = [s for s in running if not s.is_finished]
        toks = sum(len(s.completion_ids) + len(s.trace.tail_ids) for s in seqs)
        fwd = sum(s.num_forwards for s in seqs)
        print(f"| {strategy} | {toks} | {fwd} | {toks / fwd:.2f} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu")
    if args.quick:
        cache_table(["tiny-1M"], [1, 8], 32, 16)
    else:
        cache_table(["tiny-1M", "sdar-100M"], [1, 8, 32], 64, 32)
    tpf_table(16)


if __name__ == "__main__":
    main()
