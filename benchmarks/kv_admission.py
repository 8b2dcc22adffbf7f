"""KV admission on a rollout-like workload: worst-case reservation (today) vs optimistic admission.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_admission.py                 # tiny model, ~1 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/kv_admission.py --requests 16 --json /tmp/kv.json   # dry run

Each request has an actual length (uniform 1..2 x mean - 1, EOS ignored: the length stands for where an RL
rollout stops) and declares max_tokens = 4 x the mean, as rollouts do. One KV pool of `--pool-seqs`
worst-case sequences' pages is shared; the decoder's own cache is sized past it, so the admission rule
alone decides how many run. Three rules, same requests, same seeds:
- `reserve`: the scheduler's default (dllm.scheduler, server.kv_admission=reserve): a sequence is admitted
  when the pages of its prompt + max_tokens are free and holds them until it ends;
- `optimistic`: `KVBudget(optimistic=True)` (server.kv_admission=optimistic): admitted when the pages its
  next forward touches are free, growing block by block; when the running sequences' next blocks no
  longer fit, the newest is preempted (pages back, tokens and trace kept) and, re-admitted, its
  clean prefix is recomputed into the cache by one cache-filling forward (vLLM's preemption by
  recompute). Its tokens and steps must equal `reserve`'s (checked: `same`);
- `oracle`: admitted on the pages its actual length needs, reserved up front (perfect knowledge of where
  each rollout stops, never preempted; optimistic admission can beat it: it counts only pages in use).
Every rule runs the scheduler (its block manager decides admission, on the same pool of pages) and the
runner, as the server's engine does (`dllm.decoding.Decoder`); prefix sharing is off (distinct prompts).
Reported: tokens/s, mean running sequences per forward, forwards, cache-refill forwards, preemptions.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllm.config import SDARConfig  # noqa: E402
from dllm.decoding import Decoder  # noqa: E402
from dllm.model import SDARForCausalLM  # noqa: E402
from dllm.postprocess import Postprocessor  # noqa: E402
from dllm.runner import BlockRunner  # noqa: E402
from dllm.sampling import SamplingParams  # noqa: E402
from dllm.sequence import Sequence  # noqa: E402
from dllm.trace import FinishReason  # noqa: E402

TINY: dict[str, Any] = dict(vocab_size=100, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, block_size=4, mask_token_id=99, eos_token_id=0)


@dataclass
class Job:
    prompt: list[int]
    length: int  # tokens it actually generates
    declared: int  # its max_tokens (what `reserve` holds pages for)
    seed: int


def workload(n: int, mean: int, prompt_len: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [Job([rng.randrange(1, 98) for _ in range(prompt_len)], rng.randint(1, 2 * mean - 1), 4 * mean,
                rng.randrange(1 << 30)) for _ in range(n)]


def pages(tokens: int, block: int) -> int:
    return -(-tokens // block)


class StopsAtLength(Postprocessor):
    """Ends each sequence at its job's actual length (where the rollout stops), whatever max_tokens it
    declared (what the scheduler reserves pages for)."""

    def __init__(self, actual: dict[int, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.actual = actual

    def commit_block(self, s: Sequence) -> FinishReason | None:
        declared = s.params.max_tokens
        s.params.max_tokens = min(declared, self.actual[s.seq_id])
        try:
            return super().commit_block(s)
        finally:
            s.params.max_tokens = declared


def run(model: SDARForCausalLM, jobs: list[Job], rule: str, pool: int, max_batch: int) -> dict:
    B = model.config.block_size
    need = max(pages(len(j.prompt) + j.declared, B) for j in jobs)
    runner = BlockRunner(model, max_batch=max_batch, max_len=need * B, eos_ids=[0], num_pages=pool,
                         optimistic=rule == "optimistic", prefix_sharing=False)
    seqs = [runner.new_sequence(j.prompt, SamplingParams(max_tokens=j.length if rule == "oracle" else j.declared,
                                                         seed=j.seed, ignore_eos=True, strategy="static"))
            for j in jobs]
    dec = Decoder(runner)
    dec.scheduler.post = StopsAtLength({s.seq_id: j.length for s, j in zip(seqs, jobs)}, eos_ids=[0],
                                       tokenizer=None, max_len=runner.cache_len, block_size=B)
    dec.add(seqs)
    forwards = running_sum = 0
    t0 = time.perf_counter()
    while not dec.is_done:
        ended = dec.step()
        forwards += 1
        running_sum += dec.scheduler.num_running + len(ended)  # the step's batch
    wall = time.perf_counter() - t0
    tokens = sum(len(s.completion_ids) for s in seqs)
    return dict(rule=rule, wall_s=wall, tokens=tokens, tok_s=tokens / wall, mean_running=running_sum / forwards,
                forwards=forwards, fill_forwards=runner.num_fill_forwards,
                preempted=sum(s.num_preemptions for s in seqs),
                outputs=[(s.completion_ids, s.trace.steps, s.trace.logprobs) for s in seqs])


def same(a: list, b: list) -> bool:
    """Same tokens and steps, logprobs within 1e-5 (a recomputed cache may round differently)."""
    return all(x[0] == y[0] and x[1] == y[1] and max((abs(p - q) for p, q in zip(x[2], y[2])), default=0) < 1e-5
               for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--mean", type=int, default=32, help="mean actual completion length")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--pool-seqs", type=int, default=4, help="the KV pool holds this many worst-case sequences")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = SDARForCausalLM(SDARConfig(**TINY)).eval()
    jobs = workload(args.requests, args.mean, args.prompt_len, seed=1)
    B = model.config.block_size
    pool = args.pool_seqs * pages(args.prompt_len + 4 * args.mean, B)
    print(f"tiny model, {args.requests} requests, prompt {args.prompt_len}, actual length mean "
          f"{sum(j.length for j in jobs) / len(jobs):.1f} (1..{2 * args.mean - 1}), max_tokens {4 * args.mean}, "
          f"pool {pool} pages of {B} tokens (= {args.pool_seqs} worst-case sequences), max_batch {args.max_batch}\n")
    run(model, jobs[:4], "reserve", pool, args.max_batch)  # warm-up
    rows = [run(model, jobs, rule, pool, args.max_batch) for rule in ("reserve", "optimistic", "oracle")]
    ref = rows[0]["outputs"]
    print("| admission | tok/s | wall s | mean running | forwards | refill forwards | preempted | "
          "same tokens + trace |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        r["same"] = same(r.pop("outputs"), ref)
        print(f"| {r['rule']} | {r['tok_s']:,.0f} | {r['wall_s']:.2f} | {r['mean_running']:.1f} | {r['forwards']} | "
              f"{r['fill_forwards']} | {r['preempted']} | {'yes' if r['same'] else 'NO'} |")
    base = rows[0]["tok_s"]
    print(f"\noptimistic / reserve: {rows[1]['tok_s'] / base:.2f}x tok/s; oracle / reserve: "
          f"{rows[2]['tok_s'] / base:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
