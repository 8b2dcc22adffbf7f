"""dlrl's native engine vs LMDeploy's PyTorch engine, side by side on one GPU, through dlrl's own Engine.

    python benchmarks/lmdeploy_vs_native.py --json runs/lmdeploy_vs_native.json      # GPU, SDAR-1.7B shape
    python benchmarks/lmdeploy_vs_native.py --dry-run                                 # CPU: tiny, native half

The model: SDAR-1.7B-Chat's shape (tests/fixtures config, 28 layers, bf16, random weights, the stand-in
Qwen tokenizer: dllm.embedded.standin.build_real_shape_folder), written once to --model-dir. Per strategy
(static: block_size steps; dynamic: threshold 0.9) and batch (1 / 32 / 128 prompts of --prompt-len
tokens, --max-tokens new tokens each, EOS ignored, greedy): the server's Engine over each runner --
`NativeBackend` with CUDA graphs, `LMDeployRunner` (server.backend=lmdeploy, CUDA graphs on) -- after an
untimed warm-up at that batch. Reported per row: tokens/s, ms per denoising forward (native: wall /
decoder forwards; LMDeploy reports no forward count, so ms per completed block per sequence instead),
peak CUDA memory allocated in the process (weights + each engine's KV cache as configured), the share of
sequences whose greedy tokens equal the other backend's (and of tokens up to the first difference), and
the weight-update time of each (a full set of host tensors: native copy_into_model; LMDeploy sleep ->
update_params -> wakeup).

Each backend x strategy runs in its own subprocess (`--part`), so one engine's memory and CUDA state never
meets another's; the parent merges their JSON and prints the table. `--dry-run` runs the native part on
CPU at a tiny size (batches 1 2, 8 tokens) and checks the LMDeploy part's configuration (engine kwargs,
which parameters map) without lmdeploy; the LMDeploy rows then say why they did not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXTURE = ROOT / "tests" / "fixtures" / "sdar-1.7b-chat.config.json"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 4096}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", default="runs/sdar-1.7b-random", help="the random SDAR-shaped folder (built once)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--strategies", nargs="+", default=["static", "dynamic"], choices=["static", "dynamic"])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--backends", nargs="+", default=["native", "lmdeploy"], choices=["native", "lmdeploy"])
    p.add_argument("--json", default="", help="write every row here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, native half only (+ LMDeploy config check)")
    p.add_argument("--part", default="", help=argparse.SUPPRESS)  # backend:strategy (a subprocess)
    p.add_argument("--part-json", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.layers, args.batches, args.max_tokens, args.prompt_len = 1, [1, 2], 8, 6
        if args.model_dir == p.get_default("model_dir"):
            args.model_dir = str(Path(tempfile.gettempdir()) / "dlrl-lmdeploy-dry")
    if any(b < 1 for b in args.batches) or args.max_tokens < 1 or args.prompt_len < 1:
        p.error("--batches, --max-tokens and --prompt-len must be >= 1")
    return args


def build_model(args: argparse.Namespace) -> str:
    import torch

    from dllm.embedded.standin import build_real_shape_folder

    out = Path(args.model_dir)
    if not (out / "config.json").is_file():
        build_real_shape_folder(out, FIXTURE, num_hidden_layers=args.layers, overrides=TINY if args.dry_run else None,
                                dtype=torch.bfloat16, max_shard_bytes=1 << 30)
    return str(out)


def prompts(args: argparse.Namespace, vocab: int, batch: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(batch)
    return torch.randint(1000 if vocab > 4000 else 1, min(vocab, 100_000) - 2, (batch, args.prompt_len),
                         generator=g).tolist()


# ---------------------------------------------------------------------------------------------- one part
def make_runner(backend: str, strategy: str, model_dir: str, args: argparse.Namespace, device: str) -> Any:
    max_len = args.prompt_len + args.max_tokens + 8
    if backend == "native":
        from server.engine.backends.native import NativeBackend

        return NativeBackend.from_pretrained(model_dir, device=device, dtype="bfloat16" if device == "cuda" else
                                             "float32", max_batch=max(args.batches), max_model_len=max_len,
                                             kv_cache_fraction=0.3, cuda_graphs=device == "cuda")
    from server.engine.backends.lmdeploy_runner import LMDeployRunner

    return LMDeployRunner.from_pretrained(model_dir, dtype="bfloat16", max_batch=max(args.batches),
                                          max_model_len=max_len, kv_cache_fraction=0.3, cuda_graphs=True,
                                          strategy=strategy, threshold=0.9, lmdeploy_steps=0)


async def decode(engine: Any, batch: list[list[int]], params: Any) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    seqs = engine.make_sequences(batch, params)
    await engine.wait(engine.submit(seqs))
    return [list(s.completion_ids) for s in seqs], time.perf_counter() - t0


def run_part(backend: str, strategy: str, model_dir: str, args: argparse.Namespace) -> list[dict]:
    import torch

    from dllm.runner import BlockRunner
    from dllm.sampling import SamplingParams
    from dllm.weights import hf_tensors
    from server.engine.engine import Engine

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    runner = make_runner(backend, strategy, model_dir, args, device)
    engine = Engine(runner, max_queue=4 * max(args.batches)).start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, strategy=strategy, ignore_eos=True,
                            threshold=0.9)
    rows = []
    try:
        for b in args.batches:
            batch = prompts(args, runner.vocab_size, b)
            asyncio.run(decode(engine, batch, params))  # warm-up: graphs captured, kernels built
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            native = isinstance(runner, BlockRunner)  # LMDeploy counts no denoising forwards of its own
            forwards0 = runner.num_forwards if native else 0
            tokens, seconds = asyncio.run(decode(engine, batch, params))
            forwards = runner.num_forwards - forwards0 if native else 0
            num = sum(map(len, tokens))
            blocks = -(-args.max_tokens // runner.block_size)
            rows.append({"backend": backend, "strategy": strategy, "batch": b, "tokens": num, "seconds": seconds,
                         "tok_s": num / seconds, "forwards": forwards,
                         "ms_per_forward": 1e3 * seconds / forwards if forwards else None,
                         "ms_per_block": 1e3 * seconds / blocks,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                         "greedy": tokens, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"})
        named = [(n, t.detach().to("cpu", copy=True)) for n, t in hf_tensors(runner.model)]
        t0 = time.perf_counter()
        asyncio.run(engine.apply_update(1, lambda: apply(runner, named)))
        if device == "cuda":
            torch.cuda.synchronize()
        for r in rows:
            r["update_s"] = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return rows


def apply(runner: Any, named: list) -> None:
    own = getattr(runner, "apply_weights", None)
    if own is not None:
        own(named)
    else:
        from dllm.weights import copy_into_model

        copy_into_model(runner.model, named, strict=True)


# ---------------------------------------------------------------------------------------------- parent
def lmdeploy_check(args: argparse.Namespace, model_dir: str) -> str:
    """Without a GPU: the LMDeploy part's configuration, checked; the reason it does not run."""
    from dllm.config import load_model_config
    from server.engine.backends import BackendUnavailable, check_backend
    from server.engine.backends.lmdeploy_params import DLLMSettings, engine_kwargs

    cfg = load_model_config(model_dir)
    for strategy in args.strategies:
        s = DLLMSettings.from_server(block_size=cfg.block_size, strategy=strategy, steps=0, threshold=0.9)
        kw = engine_kwargs(s, max_batch=max(args.batches), max_len=args.prompt_len + args.max_tokens + 8,
                           dtype="bfloat16", kv_cache_fraction=0.3, cuda_graphs=True)
        print(f"lmdeploy {strategy}: PytorchEngineConfig({', '.join(f'{k}={v!r}' for k, v in kw.items())})")
    try:
        check_backend("lmdeploy")
    except BackendUnavailable as e:
        return str(e)
    return ""


def agreement(rows: list[dict]) -> None:
    """Per (strategy, batch): share of sequences / tokens (up to the first difference) equal across backends."""
    by = {(r["backend"], r["strategy"], r["batch"]): r for r in rows}
    for r in rows:
        other = by.get(("lmdeploy" if r["backend"] == "native" else "native", r["strategy"], r["batch"]))
        if other is None:
            continue
        pairs = list(zip(r["greedy"], other["greedy"]))
        same = sum(a == b for a, b in pairs)
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs)
        r["greedy_seq_equal"] = same / max(len(pairs), 1)
        r["greedy_prefix_equal"] = prefix / max(sum(len(a) for a, _ in pairs), 1)


def table(rows: list[dict], skipped: dict[str, str]) -> str:
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = ["| backend | strategy | batch | tok/s | ms/forward | ms/block | peak GiB | greedy seq = | greedy prefix = "
             "| update s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['backend']} | {r['strategy']} | {r['batch']} | {r['tok_s']:.0f} | "
              f"{f(r['ms_per_forward'], '.2f')} | {r['ms_per_block']:.1f} | {f(r['peak_gib'], '.2f')} | "
              f"{f(r.get('greedy_seq_equal'), '.2f')} | {f(r.get('greedy_prefix_equal'), '.2f')} | "
              f"{r['update_s']:.3f} |" for r in rows]
    lines += [f"| {name} | not run: {why} |" for name, why in skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    if args.part:
        backend, strategy = args.part.split(":")
        rows = run_part(backend, strategy, args.model_dir, args)
        Path(args.part_json).write_text(json.dumps(rows))
        return rows
    model_dir = build_model(args)
    skipped: dict[str, str] = {}
    backends = list(args.backends)
    if "lmdeploy" in backends:
        why = lmdeploy_check(args, model_dir)
        if why or args.dry_run:
            skipped["lmdeploy"] = why or "--dry-run"
            backends.remove("lmdeploy")
    rows: list[dict] = []
    for backend in backends:
        for strategy in args.strategies:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [sys.executable, __file__, "--part", f"{backend}:{strategy}", "--part-json", out.name,
                       "--model-dir", model_dir, "--layers", str(args.layers), "--max-tokens", str(args.max_tokens),
                       "--prompt-len", str(args.prompt_len), "--batches", *map(str, args.batches)]
                cmd += ["--dry-run"] if args.dry_run else []
                done = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [str(ROOT), os.environ.get("PYTHONPATH", "")])), check=False)
                if done.returncode:
                    skipped[f"{backend} {strategy}"] = f"exit {done.returncode} (see its output above)"
                    continue
                rows += json.loads(Path(out.name).read_text())
    agreement(rows)
    print(table(rows, skipped))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))
    return rows


if __name__ == "__main__":
    main()
