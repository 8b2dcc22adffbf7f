"""Decoding benchmark: the engine's cost over its model forwards, old engine vs new, side by side.

    .venv/bin/python benchmarks/decode.py                 # tiny + ~100M random SDAR, batch 1/8/32/64
    .venv/bin/python benchmarks/decode.py --quick         # tiny only, batch 1/8
    .venv/bin/python benchmarks/decode.py --old-ref main  # compare with another git ref
    .venv/bin/python benchmarks/decode.py --static-only   # today's engine vs the static step (eager, compiled)
    python benchmarks/decode.py --device cuda --json out.json  # SDAR-1.7B shape, random bf16 (benchmarks/decode_device.py)

For each model, strategy (static, dynamic) and batch size, both engines decode the same
prompts with the same parameters (seeded sampling at temperature 1, max_tokens new
tokens, EOS ignored). Reported: tokens/s, and the **overhead ratio** = decode wall time /
time of the same model forwards alone: every forward the engine made (prefill, denoising,
block commits) is recorded and run again, in order, on the same cache without the engine.
A ratio of 1.0 is the physical limit: all time spent in the model. The old engine is
`dllm.decoding` at git ref OLD_ENGINE_REF (benchmarks/oldref.py), imported next to
today's in the same process. Then tokens per denoising forward for the strategies.

First table: the static decode step (dllm/step.py), eager and `torch.compile`d, against
today's engine (TODAY_REF, the commit before it) on the embedded default's shape, with one
cache shape for every batch size (as a server has); the compiled step's variants are
compiled in an untimed warm-up run. The static step's forwards are recorded at its
bucketed shapes and replayed eagerly through `model(...)`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.oldref import OLD_ENGINE_REF, load_package  # noqa: E402
from dllm import decoding  # noqa: E402
from dllm.config import SDARConfig  # noqa: E402
from dllm.model import SDARForCausalLM  # noqa: E402
from dllm.sampling import SamplingParams  # noqa: E402

TODAY_REF = "2bdf442"  # main before the static decode step

MODELS = {  # tiny: the embedded default's architecture (char vocab); 100M: SDAR shapes scaled down
    "tiny": dict(vocab_size=100, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "sdar-100M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}


def build(name: str, package=None) -> SDARForCausalLM:
    cfg = SDARConfig(**MODELS[name], block_size=4, mask_token_id=MODELS[name]["vocab_size"] - 1, eos_token_id=0)
    torch.manual_seed(0)
    model = SDARForCausalLM(cfg).eval()
    if package is None:
        return model
    old = package.model.SDARForCausalLM(package.config.SDARConfig.from_dict(cfg.to_dict())).eval()
    old.load_state_dict(dict(model.hf_named_tensors()), strict=not cfg.tie_word_embeddings)  # HF names
    return old


def decode(engine, model, prompts, params, **kw) -> tuple[int, float, float, list]:
    """Decode with `engine` (a dllm.decoding module; `kw` for its runner, or an older ref's BlockDecoder) ->
    (tokens, wall s, CPU s, recorded forward calls)."""
    calls = []
    hook = model.register_forward_pre_hook(lambda _m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    kw.setdefault("max_batch", len(prompts))
    max_len = len(prompts[0]) + params.max_tokens + 4
    if hasattr(engine, "BlockDecoder"):  # an older ref's engine: its decoder kept its own pool
        dec = engine.BlockDecoder(model, max_len=max_len, eos_ids=[], **kw)
        step = getattr(dec, "decode", None)
        if step is not None:  # the static step runs the model's layers itself: record its forwards' inputs
            fn = step.fn
            step.fn = lambda m, cache, rows, k_pos, out_rows, filtered, *rest: calls.append(
                (cache, rows.clone(), k_pos, out_rows)) or fn(m, cache, rows, k_pos, out_rows, filtered, *rest)
        seqs = [dec.new_sequence(p, params) for p in prompts]

        def run() -> None:
            run_to_end(dec, seqs)
    else:  # today's: the scheduler, its block manager and the runner (the server engine's loop)
        runner = engine.BlockRunner(model, max_len=max_len, eos_ids=[], **kw)
        typed = runner.fn
        runner.fn = lambda m, cache, x, k_pos, *rest: calls.append(
            ("typed", cache, type(x)(*(t.clone() for t in x)), k_pos)) or typed(m, cache, x, k_pos, *rest)
        new = engine.Decoder(runner)
        seqs = [runner.new_sequence(p, params) for p in prompts]

        def run() -> None:
            with torch.no_grad():
                new.add(seqs)
                new.run()
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    hook.remove()
    return sum(len(s.completion_ids) for s in seqs), wall, cpu, calls


def run_to_end(dec, seqs) -> None:
    """Add `seqs` to an older ref's decoder and step until every one has finished."""
    with torch.no_grad():
        dec.add(seqs)
        running = list(seqs)
        while running:
            dec.step(running)
            running = [s for s in running if not s.is_finished]


def static_forward(model, cache, rows, k_pos, out_rows) -> tuple[tuple, dict]:
    """The model forward of one static step of an older ref (its packed float64 rows and bucketed keys,
    logits of out_rows' count of rows), as model(*args, **kwargs)."""
    from dllm.step import columns

    B = model.config.block_size
    col = columns(B)
    pos = rows[:, col["block_start"], None].long() + torch.arange(B, device=rows.device)
    write = (rows[:, col["write"], None] > 0).expand_as(pos)
    return (rows[:, :B].long(), pos), dict(cache=cache, slots=rows[:, col["slot"]].long(), kv_len=k_pos.shape[0],
                                           write_mask=write, num_logit_rows=out_rows.shape[0])


def typed_forward(model, cache, x, k_pos) -> tuple[tuple, dict]:
    """The model forward of one of today's steps (dllm.step.StepInputs, bucketed keys), as model(*args, **kwargs)."""
    pos = x.block_start[:, None] + torch.arange(model.config.block_size, device=x.ids.device)
    return (x.ids, pos), dict(cache=cache, page_table=x.page_table, kv_len=k_pos.shape[0],
                              write_mask=x.write[:, None].expand_as(pos), num_logit_rows=x.k.shape[0])


def replay(model, calls) -> tuple[float, float]:
    """Run the recorded forwards again, in order, without the engine -> (wall s, CPU s)."""
    calls = [typed_forward(model, *c[1:]) if c[0] == "typed" else static_forward(model, *c) if len(c) == 4 else c
             for c in calls]
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for args, kwargs in calls:
            model(*args, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(engines: dict, prompts, params, repeats: int) -> dict[str, dict]:
    """engines: name -> (dllm.decoding module, model[, runner kwargs]). Runs alternate between the
    engines (drift on a shared box hits all alike); best of `repeats` for decode and replay separately."""
    runs: dict[str, list] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, (engine, model, *kw) in engines.items():
            tokens, wall, cpu, calls = decode(engine, model, prompts, params, **(kw[0] if kw else {}))
            runs[name].append((wall, cpu, *replay(model, calls), tokens, len(calls)))
    out = {}
    for name, rs in runs.items():
        wall, cpu, fwd_wall, fwd_cpu = (min(r[i] for r in rs) for i in range(4))
        tokens, num_calls = rs[0][4], rs[0][5]
        out[name] = {"tok_s": tokens / wall, "tok_s_cpu": tokens / cpu, "ratio": wall / fwd_wall,
                     "ratio_cpu": cpu / fwd_cpu, "forwards": num_calls}
    return out


def engine_table(names, batches, prompt_len, max_tokens, repeats, old_ref):
    old = load_package("dllm", old_ref)
    print(f"\n## Engine overhead: old ({old_ref}) vs new, prompt {prompt_len}, {max_tokens} new tokens, "
          "temperature 1 (seeded), block 4")
    print("tok/s from wall clock (and from process CPU time, which other tenants of a shared box disturb "
          "less); ratio = decode time / time of the same forwards replayed alone, wall (CPU); 1.0 = all "
          "time in the model\n")
    print("| model | strategy | batch | forwards old / new | old tok/s | new tok/s | speed-up | old ratio | "
          "new ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        engines = {"old": (old.decoding, build(name, old)), "new": (decoding, build(name))}
        g = torch.Generator().manual_seed(1)
        for strategy in ("static", "dynamic"):
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, strategy=strategy, seed=0, ignore_eos=True)
            measure(engines, [[1] * 8], params, 1)  # warm-up
            for b in batches:
                prompts = [torch.randint(1, MODELS[name]["vocab_size"] - 1, (prompt_len,), generator=g).tolist()
                           for _ in range(b)]
                r = measure(engines, prompts, params, repeats)
                o, n = r["old"], r["new"]
                print(f"| {name} | {strategy} | {b} | {o['forwards']} / {n['forwards']} | {o['tok_s']:,.0f} "
                      f"({o['tok_s_cpu']:,.0f}) | {n['tok_s']:,.0f} ({n['tok_s_cpu']:,.0f}) | "
                      f"{n['tok_s'] / o['tok_s']:.2f}x ({n['tok_s_cpu'] / o['tok_s_cpu']:.2f}x) | "
                      f"{o['ratio']:.2f} ({o['ratio_cpu']:.2f}) | {n['ratio']:.2f} ({n['ratio_cpu']:.2f}) |", flush=True)


def static_table(batches, max_tokens, repeats, today_ref):
    """The embedded default's architecture: today's engine vs the static step, eager and compiled."""
    today = load_package("dllm", today_ref)
    fixed = dict(max_batch=max(batches), num_pages=max(batches) * (max_tokens + 24) // 4)  # one cache shape for all
    engines = {"today": (today.decoding, build("tiny", today), fixed), "static": (decoding, build("tiny"), fixed),
               "compiled": (decoding, build("tiny"), dict(fixed, compile=True))}
    print(f"\n## Static decode step (tiny = the embedded default's shape): today ({today_ref}) vs static step "
          f"eager vs static step torch.compile'd; prompt 16, {max_tokens} new tokens, temperature 1 (seeded)\n")
    print("tok/s wall (CPU); ratio = decode time / the same forwards replayed alone (eager), wall (CPU)\n")
    print("| strategy | batch | today tok/s | static tok/s | compiled tok/s | compiled / today | today ratio | "
          "static ratio | compiled ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(1)
    for strategy in ("static", "dynamic"):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, strategy=strategy, seed=0, ignore_eos=True)
        for b in batches:
            prompts = [torch.randint(1, 99, (16,), generator=g).tolist() for _ in range(b)]
            measure(engines, prompts, params, 1)  # warm-up (the compiled step's variants compile here)
            r = measure(engines, prompts, params, repeats)
            t, s, c = r["today"], r["static"], r["compiled"]
            print(f"| {strategy} | {b} | {t['tok_s']:,.0f} ({t['tok_s_cpu']:,.0f}) | {s['tok_s']:,.0f} "
                  f"({s['tok_s_cpu']:,.0f}) | {c['tok_s']:,.0f} ({c['tok_s_cpu']:,.0f}) | {c['tok_s'] / t['tok_s']:.2f}x "
                  f"({c['tok_s_cpu'] / t['tok_s_cpu']:.2f}x) | {t['ratio']:.2f} ({t['ratio_cpu']:.2f}) | "
                  f"{s['ratio']:.2f} ({s['ratio_cpu']:.2f}) | {c['ratio']:.2f} ({c['ratio_cpu']:.2f}) |", flush=True)


def tpf_table(max_tokens):
    sft = Path("runs/tiny-sft")
    if (sft / "config.json").is_file():
        from dllm.embedded.task import ArithmeticTask
        from dllm.tokenizer import encode, load_tokenizer
        from dllm.weights import load_pretrained
        model, tok = load_pretrained(sft), load_tokenizer(sft)
        prompts = [encode(tok, e["prompt"]) for e in ArithmeticTask().split("heldout", 64)]
        label = "tiny SFT (runs/tiny-sft), held-out prompts"
    else:
        model = build("tiny")
        prompts = [[1 + i % 50] * 6 for i in range(64)]
        label = "tiny random weights"
    print(f"\n## Tokens per denoising forward ({label}, batch 64, max {max_tokens} tokens, greedy)\n")
    print("| strategy | tokens | forwards | tokens/forward |")
    print("|---|---:|---:|---:|")
    for strategy, kw in [("static", {}), ("static steps=2", {"steps": 2}), ("dynamic thr=0.9", {"threshold": 0.9}),
                         ("dynamic thr=0.7", {"threshold": 0.7}), ("dynamic thr=0.7 steps=2",
                                                                   {"threshold": 0.7, "steps": 2})]:
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, strategy=strategy.split()[0], **kw)
        outs = decoding.generate(model, prompts, p)
        toks = sum(len(o.completion_ids) + len(o.trace.tail_ids) for o in outs)
        fwd = sum(o.num_forwards for o in outs)
        print(f"| {strategy} | {toks} | {fwd} | {toks / fwd:.2f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--old-ref", default=OLD_ENGINE_REF, help="git ref of the old engine")
    ap.add_argument("--repeats", type=int, default=3, help="best of n runs per row")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--today-ref", default=TODAY_REF, help="git ref of today's engine (the static step's baseline)")
    ap.add_argument("--static-only", action="store_true", help="only the static-step table")
    ap.add_argument("--device", default="", help="cuda | cpu: the real-shape table of benchmarks/decode_device.py "
                    "instead of the CPU tables (its own flags follow)")
    args, rest = ap.parse_known_args()
    if args.device:  # its own script (it imports this one's decode loop): run, not imported
        script = Path(__file__).with_name("decode_device.py")
        cmd = [sys.executable, str(script), "--device", args.device, "--repeats", str(args.repeats), *rest]
        return subprocess.run(cmd, check=False).returncode
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu")
    static_table([1, 8] if args.quick else [1, 8, 32], 16 if args.quick else 64, 1 if args.quick else args.repeats,
                 args.today_ref)
    if args.static_only:
        return None
    if args.quick:
        engine_table(["tiny"], [1, 8], 16, 16, 1, args.old_ref)
    else:
        if "tiny" in args.models:
            engine_table(["tiny"], [1, 8, 32, 64], 16, 32, args.repeats, args.old_ref)
        if "sdar-100M" in args.models:
            engine_table(["sdar-100M"], [1, 8, 32, 64], 16, 16, max(1, args.repeats - 1), args.old_ref)
    tpf_table(16)
    return None


if __name__ == "__main__":
    main()
