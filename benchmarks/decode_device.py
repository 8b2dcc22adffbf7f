"""Decode speed at the SDAR-1.7B-Chat shape (tests/fixtures config, random weights) on a GPU:
tok/s and ms per denoising forward for eager / CUDA-graph / compiled static decode steps.

    python benchmarks/decode.py --device cuda --json out.json             # the GPU table (28 layers, bf16)
    python benchmarks/decode_device.py --device cuda --modes compile --batches 32 128 --strategies static
    python benchmarks/decode_device.py --device cpu --layers 1 --batches 1 2 --max-tokens 8 \\
        --set hidden_size=256 intermediate_size=512 vocab_size=4096 --modes eager compile   # dry run

One BlockRunner per mode (driven by dllm.decoding.Decoder: the scheduler's loop) with `max_batch` = the largest batch (one cache shape for every batch,
as a server has). Per (mode, strategy, batch): an untimed warm-up run (CUDA graphs are captured,
compiled variants built here), then the best of `--repeats` timed runs (seeded sampling at
temperature 1, EOS ignored; the random model is never confident, so dynamic decoding commits
about one token per forward like static). Reported: tokens/s, forwards, ms per forward (engine
wall time / forwards), for eager also the same forwards replayed through the model alone
(benchmarks/decode.py's `replay`, SDPA as in the step) and their ratio; for graphs / compiled runs whether the tokens
equal the eager run's. `--profile`: kernels launched per decode step (torch.profiler, one step
mid-decode, batch 1) per mode, the top kernels written next to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode import replay  # noqa: E402
from dllm.config import SDARConfig  # noqa: E402
from dllm.decoding import Decoder  # noqa: E402
from dllm.model import SDARForCausalLM  # noqa: E402
from dllm.runner import BlockRunner  # noqa: E402
from dllm.sampling import SamplingParams  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "sdar-1.7b-chat.config.json"


def build(device: str, dtype: torch.dtype, layers: int | None, overrides: dict) -> SDARForCausalLM:
    data = json.loads(FIXTURE.read_text())
    data.update(overrides)
    if layers:
        data["num_hidden_layers"] = layers
    cfg = SDARConfig.from_dict(data)
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the device: seconds, not a minute of CPU init
        return SDARForCausalLM(cfg).to(dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(runner: BlockRunner, prompts, params, device: str, record: list | None = None):
    """Decode `prompts` to the end -> (tokens, wall s, forwards, completions); pages and slots back after."""
    fn, forwards = runner.fn, runner.num_forwards
    if record is not None:  # the static step's inputs, for the model-alone replay
        runner.fn = lambda m, cache, x, k_pos, *rest: record.append(
            ("typed", cache, type(x)(*(t.clone() for t in x)), k_pos)) or fn(m, cache, x, k_pos, *rest)
    dec = Decoder(runner)
    seqs = [runner.new_sequence(p, params) for p in prompts]
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        dec.add(seqs)
        dec.run()
    sync(device)
    wall = time.perf_counter() - t0
    runner.fn = fn
    return (sum(len(s.completion_ids) for s in seqs), wall, runner.num_forwards - forwards,
            [s.completion_ids for s in seqs])


def count_kernels(runner: BlockRunner, prompt, params, out: Path | None, label: str, device: str) -> int:
    """CUDA kernels launched by one decode step mid-decode (batch 1); 0 on a CPU (a dry run)."""
    from torch.profiler import ProfilerActivity, profile

    dec = Decoder(runner)
    with torch.no_grad():
        dec.add(runner.new_sequence(prompt, params))
        dec.step()
        dec.step()
        sync(device)
        cuda = device.startswith("cuda")
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            dec.step()
            sync(device)
        dec.run()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if out is not None:
        sort = "device_time_total" if device.startswith("cuda") else "cpu_time_total"
        out.with_name(out.stem + f".kernels-{label}.txt").write_text(prof.key_averages().table(
            sort_by=sort, row_limit=25))
    return len(kernels)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=0, help="0: the config's (28)")
    ap.add_argument("--set", nargs="*", default=[], help="config.json overrides key=int (dry runs)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128])
    ap.add_argument("--strategies", nargs="+", default=["static", "dynamic"])
    ap.add_argument("--modes", nargs="+", default=["eager", "graphs"],
                    choices=["eager", "graphs", "compile", "compile-graphs"],
                    help="compile: per-bucket static torch.compile; compile-graphs: that, captured as CUDA graphs")
    ap.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flash"],
                    help="the decode step's attention over the cache (flash: flash-attn, CUDA fp16/bf16)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="count kernels per decode step (CUDA)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    overrides = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    t0 = time.perf_counter()
    model = build(args.device, getattr(torch, args.dtype), args.layers or None, overrides)
    cfg = model.config
    print(f"torch {torch.__version__}, device {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {cfg.num_hidden_layers} layers, "
          f"{args.dtype}, built in {time.perf_counter() - t0:.1f}s; prompt {args.prompt_len}, "
          f"{args.max_tokens} new tokens, block {cfg.block_size}", flush=True)
    out = Path(args.json) if args.json else None
    g = torch.Generator().manual_seed(1)
    prompts_all = [torch.randint(1, cfg.vocab_size - 1000, (args.prompt_len,), generator=g).tolist()
                   for _ in range(max(args.batches))]
    results: list[dict] = []
    eager_tokens: dict = {}
    print("\n| mode | strategy | batch | tok/s | forwards | ms/forward | model-alone ms/fwd | ratio | "
          "tokens = eager |\n|---|---|---:|---:|---:|---:|---:|---:|---|", flush=True)
    for mode in args.modes:
        t1 = time.perf_counter()
        dec = BlockRunner(model, max_batch=max(args.batches), max_len=args.prompt_len + args.max_tokens + 4,
                          eos_ids=[], compile=mode.startswith("compile"), cuda_graphs=mode.endswith("graphs"),
                          attention=args.attention)
        setup = time.perf_counter() - t1
        for strategy in args.strategies:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, strategy=strategy, seed=0,
                                    ignore_eos=True)
            for b in args.batches:
                prompts = prompts_all[:b]
                t1 = time.perf_counter()
                record: list | None = [] if mode == "eager" else None
                run_once(dec, prompts, params, args.device, record)  # warm-up: capture / compile here
                warm = time.perf_counter() - t1 + setup
                setup = 0.0
                best = min((run_once(dec, prompts, params, args.device) for _ in range(args.repeats)),
                           key=lambda r: r[1])
                tokens, wall, fwd, comps = best
                row = {"mode": mode, "strategy": strategy, "batch": b, "tok_s": tokens / wall, "forwards": fwd,
                       "ms_per_forward": 1e3 * wall / fwd, "warmup_s": warm, "tokens": tokens}
                if record is not None:
                    eager_tokens[(strategy, b)] = comps
                    os.environ["DLRL_ATTN"] = "sdpa"  # the step's attention kernel (model() picks flex on CUDA)
                    try:
                        alone = min(replay(model, record)[0] for _ in range(2))
                    finally:
                        os.environ.pop("DLRL_ATTN", None)
                    row["model_alone_ms_per_forward"] = 1e3 * alone / len(record)
                    row["ratio"] = wall / fwd / (alone / len(record))
                elif (strategy, b) in eager_tokens:
                    row["tokens_equal_eager"] = comps == eager_tokens[(strategy, b)]
                results.append(row)
                print(f"| {mode} | {strategy} | {b} | {row['tok_s']:,.0f} | {fwd} | {row['ms_per_forward']:.2f} | "
                      f"{row.get('model_alone_ms_per_forward', float('nan')):.2f} | {row.get('ratio', float('nan')):.2f}"
                      f" | {row.get('tokens_equal_eager', '')} | warm-up {warm:.1f}s", flush=True)
                if out is not None:
                    out.write_text(json.dumps(results, indent=1) + "\n")
        if args.profile:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, strategy="static", seed=0,
                                    ignore_eos=True)
            n = count_kernels(dec, prompts_all[0], params, out, mode, args.device)
            results.append({"mode": mode, "kernels_per_step_batch1": n})
            print(f"kernels per decode step ({mode}, batch 1): {n}", flush=True)
            if out is not None:
                out.write_text(json.dumps(results, indent=1) + "\n")
        del dec
    if args.device.startswith("cuda"):
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    return results


if __name__ == "__main__":
    main()
