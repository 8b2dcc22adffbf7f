"""Device checks of issue 39 that benchmarks/decode_device.py does not cover, on CUDA or (dry run) on CPU.

    python benchmarks/gpu_checks.py sampler --device cuda          # the sampler compiled at SDAR's vocabulary
    python benchmarks/gpu_checks.py train --device cuda --shape sdar-1.7b --dtype bfloat16
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_checks.py sampler --device cpu --rows 2 3    # dry run
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_checks.py train --device cpu --shape tiny --lengths 24 40 72

`sampler`: `dllm.sampling.sample_static` under torch.compile (inductor: Triton on CUDA, C++ on CPU) at
151,936 tokens, with a dynamic row count (one graph) and static row counts (one graph each): PASS when
the compiled ids equal eager's and log-probs agree within 5e-5, else FAIL with the error.

`train`: the replay micro-step (noisy + clean copy forward to hidden states, chunked vocabulary
projection of the scored tokens, backward, fused AdamW step on CUDA) over a run of varying lengths padded
to length buckets (dllm.replay.bucket_length), eager vs `compile_layers` (inductor) vs compiled +
activation checkpointing: ms per micro-step, tokens/s (rows x bucket length), peak memory, graphs
compiled after the first bucket (0 = no recompilation), and the first step's loss against eager.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm.config import SDARConfig  # noqa: E402
from dllm.model import SDARForCausalLM  # noqa: E402
from dllm.replay import Rows, bucket_length, pad_rows  # noqa: E402
from dllm.sampling import sample_static  # noqa: E402

SDAR_VOCAB = 151936
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=101, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "sdar-1.7b": json.loads((ROOT / "tests/fixtures/sdar-1.7b-chat.config.json").read_text()),
}


def sampler(device: str, rows: list[int]) -> bool:
    from torch._dynamo.utils import counters

    def fn(logits: torch.Tensor, params: torch.Tensor, u: torch.Tensor, filtered: bool) -> tuple[torch.Tensor, ...]:
        return sample_static(logits, params, u, SDAR_VOCAB - 1, filtered)

    table = [[1.0, 0, 1.0, 1], [0.7, 0, 1.0, 0], [1.3, 5, 0.8, 0], [1.0, 0, 0.9, 0]]
    ok = True
    for dynamic in (True, False):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        for n in rows:
            for filtered in (False, True):
                g = torch.Generator(device=device).manual_seed(n)
                logits = torch.randn(n, 4, SDAR_VOCAB, device=device, generator=g) * 3
                params = torch.tensor([table[i % 4] for i in range(n)], dtype=torch.float64, device=device)
                u = torch.rand(n, 4, device=device, dtype=torch.float64, generator=g)
                t0 = time.perf_counter()
                try:
                    got = compiled(logits.clone(), params, u, filtered)
                    want = fn(logits.clone(), params, u, filtered)
                    good = torch.equal(got[0], want[0]) and (got[1] - want[1]).abs().max().item() < 5e-5
                    msg = "PASS" if good else "FAIL (differs from eager)"
                except Exception as e:  # report and go on: the table says what fails
                    good, msg = False, f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                ok &= good
                print(f"| sampler | {'dynamic' if dynamic else 'static'} rows | {n} | filtered={filtered} | "
                      f"{time.perf_counter() - t0:.1f}s | graphs {counters['stats']['unique_graphs']} | {msg} |",
                      flush=True)
    return ok


def replay_rows(rows: int, length: int, vocab: int, mask: int, seed: int) -> Rows:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, vocab - 2, (rows, length), generator=g)
    masked = torch.rand(rows, length, generator=g) < 0.4
    valid = torch.ones(rows, length, dtype=torch.bool)
    idx = torch.full((rows, length), -1)
    return Rows(torch.where(masked, mask, clean), clean, torch.arange(length).expand(rows, length).contiguous(),
                valid, masked, torch.where(masked, 0, idx), torch.where(masked, 0, idx), torch.zeros(rows, dtype=torch.long))


def train(device: str, shape: str, dtype: torch.dtype, rows: int, lengths: list[int], chunk: int) -> bool:
    from torch._dynamo.utils import counters

    from trainer.rl.replay import chunked_token_logprobs

    cfg = SDARConfig(**{**SHAPES[shape], "block_size": 4, "mask_token_id": SHAPES[shape]["vocab_size"] - 1})
    torch.manual_seed(0)
    base = SDARForCausalLM(cfg).to(device, dtype)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    mask, B = cfg.mask_token_id, cfg.block_size
    data = [pad_rows(replay_rows(rows, L, cfg.vocab_size, mask, i), bucket_length(L, B), 0)
            for i, L in enumerate(lengths)]
    print(f"\n{shape}: {sum(p.numel() for p in base.parameters()) / 1e9:.2f}B params, {dtype}, {rows} rows, lengths "
          f"{lengths} -> buckets {[d.clean.shape[1] for d in data]}\n")
    print("| variant | ms / micro-step | tokens/s | peak GiB | graphs after bucket 1 -> end | loss (first) |")
    print("|---|---:|---:|---:|---|---:|", flush=True)
    first_loss: dict[str, float] = {}
    for variant in ("eager", "compiled", "compiled+checkpointing"):
        model = base
        model.load_state_dict(state)
        model.train()
        model.gradient_checkpointing = variant.endswith("checkpointing")
        torch._dynamo.reset()
        counters.clear()
        if variant != "eager":
            model.compile_layers()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.startswith("cuda"))
        times, tokens, after_first = [], 0, 0
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        for i, r in enumerate([data[0], *data]):  # the first bucket twice: its first step compiles
            dev = [t.to(device) for t in (r.noisy, r.pos, r.clean, r.valid, r.target)]
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            hidden = model(dev[0], position_ids=dev[1], clean_ids=dev[2], valid=dev[3], output="hidden")
            lp, _, anchor = chunked_token_logprobs(model.lm_head, hidden[dev[4]], dev[2][dev[4]], mask, chunk=chunk)
            loss = -lp.mean() + anchor
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i == 0:
                first_loss[variant] = loss.item()
                after_first = counters["stats"]["unique_graphs"]
            else:
                times.append(time.perf_counter() - t0)
                tokens += r.clean.numel()
        if not times:
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
        print(f"| {variant} | {1e3 * sum(times) / len(times):.1f} | {tokens / sum(times):,.0f} | {peak:.1f} | "
              f"{after_first} -> {counters['stats']['unique_graphs']} | {first_loss[variant]:.5f} |", flush=True)
        model.load_state_dict(state)
    ref = first_loss["eager"]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = all(abs(v - ref) <= tol * max(1.0, abs(ref)) for v in first_loss.values())
    print(f"\nfirst-step losses equal eager within {tol}: {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("check", choices=["sampler", "train"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8], help="sampler: row counts; train: first = rows")
    ap.add_argument("--shape", default="sdar-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", type=int, nargs="+", default=[96, 160, 300, 120, 480, 250])
    ap.add_argument("--chunk", type=int, default=1024)
    args = ap.parse_args(argv)
    if args.check == "sampler":
        return 0 if sampler(args.device, args.rows) else 1
    rows = args.rows[0] if args.rows != [1, 3, 8] else 32
    return 0 if train(args.device, args.shape, getattr(torch, args.dtype), rows, args.lengths, args.chunk) else 1


if __name__ == "__main__":
    sys.exit(main())
