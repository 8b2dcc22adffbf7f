"""Full-attention costs, measured side by side in one run (issue 36):

    .venv/bin/python benchmarks/full_attention.py                 # tiny LLaDA + LLaDA-8B-shaped (1 layer)
    .venv/bin/python benchmarks/full_attention.py --quick         # tiny only
    .venv/bin/python benchmarks/full_attention.py --layers 2 --json out.json

1. Decoding: tokens/s and forwards per token of exact vs prefix-cache decoding (dllm.full.decoding) on the
   tiny LLaDA default (the trained runs/tiny-llada-sft when present, else its architecture with random
   weights) and on a LLaDA-8B-shaped random model with fewer layers (hidden 4096, 32 heads of 128, MLP 12288,
   vocabulary 126,464; `--layers`, default 1), next to the block-causal SDAR path (dllm.decoding) at the same
   shapes (SDAR-8B-like: 8 KV heads, vocabulary 151,936). Same prompts, max_tokens, block size and static
   steps for all; EOS ignored (random models), batch 1 and 4.
2. Train-serve mismatch of the prefix cache: samples decoded in prefix mode at temperature 1 (further_horizon:
   the official value, 4, 0), replayed as the trainer does (dllm.full.replay: a block's later forwards see the
   horizon's window, as the sampler did; and, for comparison, rows that see the whole canvas): mean / max
   |delta logprob| per token, and the TIS weights `trainer.rl.correction.is_weights` makes of it (token level,
   cap 2): mean, std, share truncated; exact mode alongside (0 up to float noise).
3. The static-shape step (dllm/full/step.py): seconds per denoising forward of the eager decoder (shapes that
   change every step), the bucketed static step run eagerly, and the static step compiled per bucket by
   torch.compile (inductor; buckets compiled in an untimed first pass), exact and prefix cache (the official
   horizon), on the tiny LLaDA default (batch 4) and a mid-size random LLaDA (hidden 512, 4 layers, vocabulary
   32,768, block 32, prompt 64, one block of 32; batch 1 and 2); tokens checked equal across the three.
4. Memory of the bidirectional training forward: bytes saved for backward per token per layer, measured at
   small width with the 8B proportions (saved-tensor hooks, fp32 and bf16), at two lengths to separate the
   linear and the L^2 (CPU SDPA's attention weights) terms, scaled to 8B from the shapes; the SDAR training
   layout (noisy + clean copy: 2L tokens a row) measured the same way; rows per sample of each replay.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllm.config import SDARConfig  # noqa: E402
from dllm.decoding import Decoder, generate  # noqa: E402
from dllm.embedded.full_folders import tiny_full_config  # noqa: E402
from dllm.full.config import FullAttentionConfig  # noqa: E402
from dllm.full.decoding import generate_full  # noqa: E402
from dllm.full.model import FullAttentionLM  # noqa: E402
from dllm.full.replay import build_full_rows, full_replay_hidden  # noqa: E402
from dllm.full.runner import FullRunner  # noqa: E402
from dllm.model import SDARForCausalLM  # noqa: E402
from dllm.replay import token_logprobs  # noqa: E402
from dllm.sampling import SamplingParams  # noqa: E402
from trainer.rl.correction import is_weights  # noqa: E402

LLADA_8B: dict[str, Any] = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=32,
                head_dim=128, vocab_size=126464, max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5)
SDAR_8B: dict[str, Any] = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=151936, max_position_embeddings=4096, rope_theta=1000000.0)
GIB = float(1 << 30)


def tiny_models() -> tuple[FullAttentionLM, SDARForCausalLM, str]:
    from dllm.embedded.sft_config import TinyModelConfig
    from dllm.embedded.sft_full import make_full_model
    from dllm.embedded.tiny import load_tiny_sections
    from dllm.weights import load_pretrained

    arch, _, sft = load_tiny_sections("configs/tiny_llada.yaml")
    trained = Path(sft.output_dir)
    if (trained / "config.json").is_file():
        fa, what = load_pretrained(trained), f"tiny LLaDA default (trained, {trained})"
    else:
        torch.manual_seed(0)
        fa, what = make_full_model(arch), "tiny LLaDA default arch (random weights)"
    assert isinstance(fa, FullAttentionLM)
    c = fa.config
    sdar_arch = TinyModelConfig(**{**arch.model_dump(), "num_key_value_heads": 2})
    torch.manual_seed(0)
    sdar = SDARForCausalLM(SDARConfig(vocab_size=c.vocab_size, mask_token_id=c.mask_token_id, eos_token_id=c.eos_ids,
                                      pad_token_id=c.pad_token_id, **sdar_arch.model_dump()))
    return fa.eval(), sdar.eval(), what


def big_models(layers: int, block: int, dtype: torch.dtype) -> tuple[FullAttentionLM, SDARForCausalLM]:
    torch.manual_seed(0)
    fa_cfg = FullAttentionConfig(family="llada", num_hidden_layers=layers, block_size=block, mask_token_id=126336,
                                 eos_token_id=126081, pad_token_id=126081, torch_dtype="bfloat16", **LLADA_8B)
    with torch.device("meta"):
        fa = FullAttentionLM(fa_cfg)
    fa = fa.to_empty(device="cpu").to(dtype)
    fa.init_weights()
    sd_cfg = SDARConfig(num_hidden_layers=layers, block_size=block, mask_token_id=151669, eos_token_id=151643,
                        pad_token_id=151643, **SDAR_8B)
    with torch.device("meta"):
        sdar = SDARForCausalLM(sd_cfg)
    sdar = sdar.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for n, p in sdar.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0, 0.02)
    return fa.eval(), sdar.eval()


def decode_row(name: str, fn: Any, prompts: list[list[int]], params: SamplingParams,
               warmup: bool = True) -> dict[str, Any]:
    if warmup:  # one untimed run first (allocator, first-call costs)
        fn(prompts, params)
    t0 = time.perf_counter()
    outs = fn(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.completion_ids) for o in outs)
    fwd = sum(o.num_forwards for o in outs) / len(outs)
    return {"path": name, "batch": len(prompts), "tokens": tokens, "seconds": round(wall, 2),
            "tok_per_s": round(tokens / wall, 3), "forwards_per_token": round(fwd / (tokens / len(outs)), 3)}


def bench_decode(fa: FullAttentionLM, sdar: SDARForCausalLM, prompt_len: int, max_tokens: int, steps: int,
                 batches: list[int], warmup: bool = True) -> list[dict[str, Any]]:
    rows = []
    vocab = min(fa.config.vocab_size, sdar.config.vocab_size)
    bad = {fa.config.mask_token_id, sdar.config.mask_token_id}
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = [[t for t in torch.randint(0, vocab, (prompt_len,), generator=g).tolist() if t not in bad]
                   for _ in range(b)]
        params = SamplingParams(max_tokens=max_tokens, strategy="static", steps=steps, temperature=1.0, seed=1,
                                ignore_eos=True)
        rows += [decode_row(f"full/{mode}", lambda p, q, m=mode: generate_full(fa, p, q, cache_mode=m, eos_ids=[]),
                            prompts, params, warmup) for mode in ("exact", "prefix")]
        rows.append(decode_row("sdar/kv-cache", lambda p, q: generate(sdar, p, q, eos_ids=[]), prompts, params,
                               warmup))
    return rows


@torch.no_grad()
def bench_mismatch(fa: FullAttentionLM, prompts: list[list[int]], max_tokens: int, steps: int,
                   n: int) -> dict[str, dict[str, float]]:
    import copy

    out = {}
    cfg = fa.config
    for mode, horizon, windowed in (("exact", -1, True), ("prefix", -1, True), ("prefix", 4, True),
                                    ("prefix", 4, False), ("prefix", 0, True), ("prefix", 0, False)):
        params = [SamplingParams(max_tokens=max_tokens, strategy="static", steps=steps, temperature=1.0, seed=s)
                  for s in range(n)]
        outs = generate_full(fa, [prompts[i % len(prompts)] for i in range(n)], params, cache_mode=mode,
                             further_horizon=horizon)
        name = mode if mode == "exact" else f"prefix, horizon {outs[0].trace.further_horizon}"
        if not windowed:  # rows that see the whole canvas: what the replay did before it honoured the horizon
            outs = [copy.deepcopy(o) for o in outs]
            for o in outs:
                o.trace.further_horizon = None
            name += ", rows see the whole canvas"
        rows = build_full_rows(outs, cfg.mask_token_id, cfg.pad_token_id or 0)
        hidden = full_replay_hidden(fa, rows)
        lp = torch.zeros(rows.target.shape)
        lp[rows.target] = token_logprobs(fa.lm_head(hidden[rows.target]), rows.clean[rows.target],
                                         cfg.mask_token_id).float()
        behaviour = rows.gather([o.trace.logprobs for o in outs])
        d = (lp - behaviour)[rows.target]
        w, stats = is_weights(lp - behaviour, rows.target, rows.sample_idx, "tis", "token", 2.0)
        wt = w[rows.target]
        out[name] = {"tokens": int(d.numel()), "mean_abs_dlogprob": float(d.abs().mean()),
                     "max_abs_dlogprob": float(d.abs().max()), "tis_weight_mean": float(wt.mean()),
                     "tis_weight_std": float(wt.std()), "tis_truncated_frac": stats["is_truncated_frac"]}
    return out


def decode_all(runner: FullRunner, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Decode every prompt with `runner` (the engine's loop: dllm.decoding.Decoder); -> (completions, forwards)."""
    dec = Decoder(runner)
    seqs = [runner.new_sequence(p, params) for p in prompts]
    dec.add(seqs)
    before = runner.num_forwards
    dec.run()
    return [s.completion_ids for s in seqs], runner.num_forwards - before


def bench_static(fa: FullAttentionLM, name: str, prompt_len: int, max_tokens: int, batch: int) -> list[dict[str, Any]]:
    """Eager vs the static step eagerly vs compiled (inductor), both cache modes: seconds per forward."""
    from dllm.full.step import FullStep

    g = torch.Generator().manual_seed(0)
    vocab = fa.config.vocab_size
    prompts = [[t for t in torch.randint(1, vocab, (prompt_len,), generator=g).tolist() if t != fa.config.mask_token_id]
               for _ in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, strategy="static", temperature=1.0, seed=1, ignore_eos=True)
    max_len = prompt_len + max_tokens + fa.config.block_size
    rows = []
    for mode in ("exact", "prefix"):
        base: dict[str, Any] = {}
        for kind in ("eager", "static eager", "static compiled"):
            dec = FullRunner(fa, max_batch=batch, max_len=max_len, cache_mode=mode, eos_ids=[],
                             compile="inductor" if kind == "static compiled" else False)
            if kind == "static eager":
                dec.static = FullStep(fa, max_batch=batch, max_len=dec.max_len, cache_mode=mode,
                                      further_horizon=dec.further_horizon)
            t0 = time.perf_counter()
            decode_all(dec, prompts, params)  # first pass: compiles the buckets met (untimed for the ratio)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            out, fwd = decode_all(dec, prompts, params)
            per = (time.perf_counter() - t0) / fwd
            base.setdefault("per", per)
            base.setdefault("out", out)
            rows.append({"model": name, "cache": mode, "batch": batch, "step": kind, "ms_per_forward": round(per * 1e3, 2),
                         "vs_eager": round(base["per"] / per, 2), "first_pass_s": round(first, 1),
                         "same_tokens": out == base["out"]})
    return rows


def mid_model() -> FullAttentionLM:
    torch.manual_seed(0)
    cfg = tiny_full_config("llada", block_size=32, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=8, vocab_size=32768, max_position_embeddings=1024,
                           mask_token_id=32000, eos_token_id=32001, pad_token_id=32001)
    return FullAttentionLM(cfg).eval()


def saved_bytes(model: torch.nn.Module, fn: Any) -> int:
    """Bytes of the activations autograd saves for backward while `fn()` runs (each storage once; the
    parameters, which backward also holds, are not activations and are left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def bench_memory(dtype: torch.dtype) -> dict[str, Any]:
    """Saved bytes per token per layer at width 256 with the 8B proportions, two lengths; scaled to 8B."""
    small: dict[str, Any] = dict(hidden_size=256, intermediate_size=768, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                 vocab_size=512, max_position_embeddings=4096)
    res: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch.")}
    for kind in ("full", "sdar"):
        per_len = {}
        for layers in (1, 2):
            for L in (256, 512):
                torch.manual_seed(0)
                if kind == "full":
                    m: Any = FullAttentionLM(tiny_full_config("llada", num_hidden_layers=layers, block_size=32,
                                                              **small)).to(dtype).train()
                    ids = torch.randint(0, 500, (1, L))
                    pos = torch.arange(L)[None]
                    b = saved_bytes(m, lambda m=m, ids=ids, pos=pos: m(ids, pos, output="hidden"))
                else:
                    m = SDARForCausalLM(SDARConfig(num_hidden_layers=layers, block_size=32, mask_token_id=511,
                                                   eos_token_id=0, pad_token_id=0,
                                                   **{**small, "num_key_value_heads": 1})).to(dtype).train()
                    ids = torch.randint(0, 500, (1, L))
                    pos = torch.arange(L)[None]
                    valid = torch.ones(1, L, dtype=torch.bool)
                    b = saved_bytes(m, lambda m=m, ids=ids, pos=pos, valid=valid: m(
                        ids, position_ids=pos, clean_ids=ids, valid=valid, output="hidden"))
                per_len[(layers, L)] = b
        # per layer: difference of 2 and 1 layers; a*L + c*L^2 from the two lengths
        l1, l2 = per_len[(2, 256)] - per_len[(1, 256)], per_len[(2, 512)] - per_len[(1, 512)]
        c = (l2 - 2 * l1) / (512 * 512 - 2 * 256 * 256)
        a = (l1 - c * 256 * 256) / 256
        width_scale = 4096 / 256  # every linear term is proportional to the width (MLP 3x, heads x 128 = width)
        heads_scale = 32 / 2  # the L^2 term: one L x L weight matrix per head (CPU SDPA math path only)
        res[kind] = {"small_bytes_per_token_per_layer": round(a), "small_bytes_per_L2_per_layer": round(c, 2),
                     "8b_bytes_per_token_per_layer": round(a * width_scale),
                     "8b_L2_bytes_per_layer": round(c * heads_scale, 1)}
        for L in (1024, 4096):
            lin = a * width_scale * L * 32 / GIB  # SDAR's a already holds its clean copy (2L tokens a row)
            quad = c * heads_scale * L * L * 32 / GIB
            res[kind][f"8b_row_L{L}_GiB_flash"] = round(lin, 2)  # flash / mem-efficient attention: no L^2
            res[kind][f"8b_row_L{L}_GiB_cpu_sdpa"] = round(lin + quad, 2)
    return res


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models only")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: tiny, mismatch, big, static, memory")
    ap.add_argument("--layers", type=int, default=1, help="layers of the 8B-shaped models")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--json", default="", help="write every number here too")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    skip = set(args.skip.split(",")) - {""}
    fa, sdar, what = tiny_models()
    bs = fa.config.block_size
    print(f"## decoding, {what} vs SDAR of the same shape (random), prompt 6, max_tokens 16, block {bs}, "
          f"static steps {bs}")
    if "tiny" not in skip:
        results["tiny_decode"] = bench_decode(fa, sdar, 6, 16, bs, [1, 4])
        print_table(results["tiny_decode"])
    from dllm.embedded.task import ArithmeticTask
    from dllm.tokenizer import encode, load_tokenizer

    tok_dir = "runs/tiny-llada-sft"
    if Path(tok_dir, "tokenizer.json").is_file():
        tok = load_tokenizer(tok_dir)
        prompts = [encode(tok, e["prompt"]) for e in ArithmeticTask().split("heldout", 16)]
    else:
        prompts = [[1 + i % 9, 2, 11, 3 + i % 7, 5, 12] for i in range(16)]
    print("\n## train-serve mismatch of the prefix cache (tiny LLaDA, held-out prompts, 64 samples of 8 tokens, "
          "temperature 1, static)")
    if "mismatch" not in skip:
        results["mismatch"] = bench_mismatch(fa, prompts, 8, bs, 64)
        print_table([{"mode": k, **{kk: round(vv, 5) if isinstance(vv, float) else vv for kk, vv in v.items()}}
                     for k, v in results["mismatch"].items()])
    if not args.quick and "big" not in skip:
        dtype = torch.bfloat16
        fa8, sdar8 = big_models(args.layers, 32, dtype)
        print(f"\n## decoding, LLaDA-8B shape with {args.layers} layer(s) (random bf16) vs SDAR-8B-like shape, "
              "prompt 64, max_tokens 32, block 32, static steps 16 (2 tokens a forward)")
        results["8b_decode"] = bench_decode(fa8, sdar8, 64, 32, 16, [1], warmup=False)
        print_table(results["8b_decode"])
        del fa8, sdar8
    if "static" not in skip:
        print("\n## the static-shape step: eager vs bucketed static step vs compiled per bucket (inductor), "
              "static steps = block size, temperature 1")
        results["static"] = bench_static(fa, "tiny LLaDA default", 6, 16, 4)
        if not args.quick:
            mid = mid_model()
            for batch in (1, 2):
                results["static"] += bench_static(mid, "mid LLaDA (512 x 4 layers, vocab 32768)", 64, 32, batch)
        print_table(results["static"])
    print("\n## memory of the training forward (saved for backward), measured small, scaled to 8B (32 layers)")
    for dtype in (torch.float32, torch.bfloat16) if "memory" not in skip else ():
        mem = bench_memory(dtype)
        results[f"memory_{mem['dtype']}"] = mem
        print(json.dumps(mem, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
