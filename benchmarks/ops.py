"""aten ops per decoder layer of one mid-decode forward (KV-cache path), old code vs today's, side by side.

    .venv/bin/python benchmarks/ops.py                  # old = main at OLD_REF (before fused layers)
    .venv/bin/python benchmarks/ops.py --ref 2bdf442 --dtype bfloat16
    .venv/bin/python benchmarks/ops.py --ref 177c76b --time 200   # + eager decode forwards timed, old vs new

Counted as issue 22 says: every aten op the CPU profiler records (nested ones included)
for ONE decode forward (a block of `block_size` new tokens per row, attending over a
filled prompt in the KV cache), a 4-layer model minus a 2-layer model of the same width,
halved. The per-layer count is also split into the KV-cache write (`CacheView.update`),
the attention kernel (`attend`) and the rest (the layer's own ops: norms, projections,
rope, MLP): the first two belong to the cache/attention code, the rest to dllm/model.py.
With `--time N`: the same mid-decode forward (the embedded default's shape, eager, the
static step's model call) timed for the old and the new code, interleaved, best of N, as
tokens/s (batch x block_size tokens per forward).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
OLD_REF = "2bdf442"  # main before fused QKV / gate-up and the cheaper norms, rope and MLP
PARTS = ("cache.update", "attend")


def _cache(pkg, cfg, batch: int, max_len: int, dtype: torch.dtype) -> tuple:
    """(a KV cache of `batch` rows of `max_len` positions, the model kwargs addressing it): today's cache is
    addressed by page tables, an older ref's by slots."""
    kv = pkg.kv_cache.KVCache
    if hasattr(kv, "fixed_table"):
        cache = kv(cfg, num_pages=batch * -(-max_len // cfg.block_size), device="cpu", dtype=dtype)
        return cache, {"page_table": cache.fixed_table(batch, max_len)}
    return kv(cfg, num_slots=batch, max_len=max_len, device="cpu", dtype=dtype), {"slots": torch.arange(batch)}


def _count(pkg, num_layers: int, dtype: torch.dtype, batch: int, prompt: int) -> dict[str, int]:
    """aten ops of one mid-decode forward of a `num_layers` model of package `pkg` (dllm or an old copy)."""
    from dllm.embedded.sft import TinyModelConfig

    arch = TinyModelConfig(num_hidden_layers=num_layers).model_dump()
    cfg = pkg.config.SDARConfig(vocab_size=96, mask_token_id=95, eos_token_id=[0], pad_token_id=0, **arch)
    torch.manual_seed(0)
    model = pkg.model.SDARForCausalLM(cfg).to(dtype).eval()
    bs = cfg.block_size
    cache, rows = _cache(pkg, cfg, batch, prompt + 4 * bs, dtype)
    ids = torch.randint(0, 90, (batch, prompt))
    pos = torch.arange(prompt).expand(batch, prompt)
    view_cls = pkg.kv_cache.CacheView
    update, attend = view_cls.update, pkg.model.attend

    def traced_update(self, *a, **k):
        with record_function("cache.update"):
            return update(self, *a, **k)

    def traced_attend(*a, **k):
        with record_function("attend"):
            return attend(*a, **k)

    with torch.inference_mode():
        model(ids, pos, cache=cache, **rows, kv_len=prompt)  # prefill
        step = torch.full((batch, bs), 95)
        step_pos = torch.arange(prompt, prompt + bs).expand(batch, bs)
        model(step, step_pos, cache=cache, **rows, kv_len=prompt + bs)  # warm-up decode step
        view_cls.update, pkg.model.attend = traced_update, traced_attend
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model(step, step_pos, cache=cache, **rows, kv_len=prompt + bs, num_logits=bs)
        finally:
            view_cls.update, pkg.model.attend = update, attend
    counts = {"total": 0, **dict.fromkeys(PARTS, 0)}
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        counts["total"] += 1
        parent = ev.cpu_parent
        while parent is not None:
            if parent.name in PARTS:
                counts[parent.name] += 1
                break
            parent = parent.cpu_parent
    return counts


def _decode_forward(pkg, dtype: torch.dtype, batch: int, prompt: int):
    """A closure running one mid-decode forward of the embedded default's model (2 layers) of `pkg`."""
    from dllm.embedded.sft import TinyModelConfig

    cfg = pkg.config.SDARConfig(vocab_size=96, mask_token_id=95, eos_token_id=[0], pad_token_id=0,
                                **TinyModelConfig().model_dump())
    torch.manual_seed(0)
    model = pkg.model.SDARForCausalLM(cfg).to(dtype).eval()
    bs = cfg.block_size
    cache, rows = _cache(pkg, cfg, batch, prompt + 4 * bs, dtype)
    step = torch.full((batch, bs), 95)
    step_pos = torch.arange(prompt, prompt + bs).expand(batch, bs)
    with torch.inference_mode():
        model(torch.randint(0, 90, (batch, prompt)), torch.arange(prompt).expand(batch, prompt),
              cache=cache, **rows, kv_len=prompt)

    def run():
        with torch.inference_mode():
            model(step, step_pos, cache=cache, **rows, kv_len=prompt + bs, num_logits=bs)
    return run, batch * bs


def time_forwards(old_pkg, new_pkg, dtype: torch.dtype, prompt: int, n: int) -> None:
    print(f"\neager mid-decode forward, embedded default's shape ({dtype}), tokens/s, best of {n}, interleaved")
    print(f"{'batch':>6s} {'old':>10s} {'new':>10s} {'new/old':>8s}")
    for batch in (1, 8, 32):
        fns = {"old": _decode_forward(old_pkg, dtype, batch, prompt), "new": _decode_forward(new_pkg, dtype, batch, prompt)}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(n):
            for key, (fn, _) in fns.items():
                t0 = time.perf_counter()
                fn()
                best[key] = min(best[key], time.perf_counter() - t0)
        tok = fns["new"][1]
        print(f"{batch:6d} {tok / best['old']:10,.0f} {tok / best['new']:10,.0f} {best['old'] / best['new']:8.2f}")


def per_layer(pkg, dtype: torch.dtype, batch: int, prompt: int) -> dict[str, float]:
    four, two = _count(pkg, 4, dtype, batch, prompt), _count(pkg, 2, dtype, batch, prompt)
    out = {k: (four[k] - two[k]) / 2 for k in four}
    out["layer (model.py)"] = out["total"] - sum(out[p] for p in PARTS)
    out["whole forward, 2 layers"] = two["total"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default=OLD_REF, help="git ref of the old code")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--time", type=int, default=0, metavar="N", help="also time eager decode forwards, best of N")
    args = ap.parse_args()
    from oldref import load_package

    import dllm.config
    import dllm.kv_cache
    import dllm.model

    dtype = getattr(torch, args.dtype)
    old_pkg = load_package("dllm", args.ref)
    old = per_layer(old_pkg, dtype, args.batch, args.prompt)
    new = per_layer(dllm, dtype, args.batch, args.prompt)
    print(f"aten ops per decoder layer, one mid-decode forward ({args.dtype}, batch {args.batch}, "
          f"prompt {args.prompt}); old = {args.ref}, new = working tree")
    print(f"{'':26s} {'old':>8s} {'new':>8s} {'new/old':>8s}")
    for key in old:
        ratio = new[key] / old[key] if old[key] else float("nan")
        print(f"{key:26s} {old[key]:8.1f} {new[key]:8.1f} {ratio:8.2f}")
    if args.time:
        time_forwards(old_pkg, dllm, dtype, args.prompt, args.time)


if __name__ == "__main__":
    main()
