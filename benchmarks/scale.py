"""Scale-out benchmark: step time and memory per rank, 1 vs 2 trainer ranks, ZeRO-0/2/3, and
the two ways of handing rollouts to ranks.

    .venv/bin/python benchmarks/scale.py                      # tiny + ~100M random SDAR
    .venv/bin/python benchmarks/scale.py --models tiny --steps 2
    .venv/bin/python benchmarks/scale.py --models 100M --stages 3   # one stage
    .venv/bin/python benchmarks/scale.py --no-update                # part 2 only

Part 1 (update): for each model x ZeRO stage x number of ranks, torchrun starts the ranks;
each builds the real learner (`trainer.run._build_learner`) and runs `trainer.loop.learn` on
a fixed synthetic batch of 16 prompts x 4 samples (trace-shaped rollouts, no server). Printed
per rank: seconds per step (after one warm-up step), the parameter + optimizer-state bytes it
holds, and its peak RSS. On a 2-core CPU no speed-up is expected; ZeRO-3 must cut parameter
+ optimizer memory per rank.

Part 2 (rollouts): a real `dlrl serve` and 2 ranks. (a) every rank asks the servers for its
own shard (what dlrl does); (b) rank 0 fetches the whole batch and scatters it
(`scatter_object_list`). Seconds per batch for each, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = {  # name: SDARConfig fields
    "tiny": dict(vocab_size=101, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "100M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}
NUM_PROMPTS, GROUP, PROMPT_LEN, COMPLETION_LEN, BLOCK = 16, 4, 12, 16, 4


def parity_reward(text: str, example: dict, num_tokens: int | None = None) -> float:
    return float(zlib.crc32(text.encode()) % 2)


def synthetic_rollouts(vocab: int) -> list:
    """Trace-shaped rollouts: every block's 4 tokens committed over 2 steps (static, 2 per step)."""
    import torch

    from dllm.trace import Trace
    from rollout_client.protocol.rollout import Rollout

    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(NUM_PROMPTS * GROUP):
        prompt = torch.randint(1, vocab - 1, (PROMPT_LEN,), generator=g).tolist()
        comp = torch.randint(1, vocab - 1, (COMPLETION_LEN,), generator=g).tolist()
        steps = [1 + (j % BLOCK) // 2 for j in range(COMPLETION_LEN)]
        trace = Trace(prompt_len=PROMPT_LEN, block_size=BLOCK, steps=steps,
                           logprobs=(-torch.rand(COMPLETION_LEN, generator=g) * 3).tolist())
        out.append(Rollout(prompt_index=k // GROUP, sample_index=k % GROUP, prompt_ids=prompt, completion_ids=comp,
                           text=" ".join(map(str, comp)), finish_reason="length", version=0, trace=trace))
    return out


def held_bytes(engine) -> int:
    """Parameter + optimizer-state bytes this rank holds (partitions only under ZeRO)."""
    import torch

    params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor")
                 else p.numel() * p.element_size() for p in engine.module.parameters())
    opt, seen = engine.optimizer, set()
    tensors = []
    for holder in (opt, getattr(opt, "optimizer", None)):
        state = getattr(holder, "state", None)
        for st in (state.values() if isinstance(state, dict) else []):
            tensors += [t for t in st.values() if isinstance(t, torch.Tensor)]
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        tensors += list(getattr(opt, name, []) or [])
    state_bytes = 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            state_bytes += t.numel() * t.element_size()
    return params + state_bytes


def update_worker(model: str, stage: int, steps: int) -> None:
    from types import SimpleNamespace

    import torch

    from dllm.config import SDARConfig
    from dllm.model import SDARForCausalLM
    from trainer.config import TrainConfig
    from trainer.infra.dist import Ranks
    from trainer.loop import learn
    from trainer.rl.rollouts import Batch
    from trainer.run import _build_learner

    ranks = Ranks.init()
    fields = MODELS[model]
    torch.manual_seed(0)
    policy = SDARForCausalLM(SDARConfig(**fields, block_size=BLOCK, mask_token_id=fields["vocab_size"] - 1,
                                        eos_token_id=0, max_position_embeddings=256))
    cfg = TrainConfig(zero_stage=stage, group_size=GROUP, lr=1e-5, filter_zero_variance=False)
    learner = _build_learner(cfg, ranks, policy)
    rollouts = synthetic_rollouts(fields["vocab_size"])
    shard = ranks.shard(NUM_PROMPTS)
    batch = Batch([{"prompt": "", "answer": ""}] * (shard.stop - shard.start),
                  rollouts[shard.start * GROUP: shard.stop * GROUP], shard.start * GROUP, NUM_PROMPTS * GROUP, 0.0)
    run = SimpleNamespace(cfg=cfg, ranks=ranks, learner=learner, reward_fn=parity_reward, version=0,
                          block_size=BLOCK, mask_id=fields["vocab_size"] - 1, pad_id=0, generator=torch.Generator())
    times = []
    for i in range(steps + 1):
        ranks.barrier()
        t0 = time.perf_counter()
        learn(run, batch, step=i)
        times.append(time.perf_counter() - t0)
    row = {"model": model, "zero": stage, "ranks": ranks.world_size, "rank": ranks.rank,
           "step_s": sum(times[1:]) / max(1, steps), "held_mb": held_bytes(learner.engine) / 2**20,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for r in ranks.all_gather(row):
        if ranks.is_main:
            print("ROW " + json.dumps(r), flush=True)


def fetch_worker(url: str, batches: int) -> None:
    import torch

    from trainer.infra.dist import Ranks
    from trainer.infra.fleet import ServerFleet

    ranks = Ranks.init()
    fleet = ServerFleet([url], "")
    prompts = [[5 + (p % 7), 6, 7, 8, 9][: 3 + p % 3] for p in range(NUM_PROMPTS)]
    kw = dict(max_tokens=16, strategy="static", seed=1)
    times = {"per_rank": [], "rank0_scatter": []}
    for _ in range(batches):
        ranks.barrier()
        t0 = time.perf_counter()
        mine = fleet.generate(prompts[ranks.shard(NUM_PROMPTS)], GROUP, **kw)
        ranks.barrier()
        times["per_rank"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        everything = fleet.generate(prompts, GROUP, **kw) if ranks.is_main else None
        shards = ([everything[ranks_shard(r, ranks.world_size).start * GROUP: ranks_shard(r, ranks.world_size).stop
                              * GROUP] for r in range(ranks.world_size)] if ranks.is_main else None)
        box = [None]
        torch.distributed.scatter_object_list(box, shards, src=0)
        ranks.barrier()
        times["rank0_scatter"].append(time.perf_counter() - t0)
        assert len(box[0]) == len(mine)
    fleet.close()
    if ranks.is_main:
        print("FETCH " + json.dumps({k: min(v) for k, v in times.items()}), flush=True)


def ranks_shard(rank: int, world: int) -> slice:
    from trainer.infra.dist import Ranks

    return Ranks(rank=rank, world_size=world).shard(NUM_PROMPTS)


def torchrun(nproc: int, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread per rank: 1 vs 2 ranks compare like for like
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return out.stdout.splitlines()


def bench_fetch(batches: int) -> dict:
    import httpx

    from tests.helpers import free_port

    tmp = Path(tempfile.mkdtemp(prefix="dlrl-scale-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([sys.executable, "-m", "dlrl.cli", "serve", "--config", str(ROOT / "configs/tiny.yaml"),
                            "--port", str(port), "server.max_batch=64"], cwd=ROOT, stdout=open(tmp / "srv.log", "wb"),
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        lines = [ln for ln in torchrun(2, "--fetch", url, "--batches", str(batches)) if ln.startswith("FETCH ")]
        return json.loads(lines[0][6:])
    finally:
        srv.terminate()
        srv.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,100M")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stages", default="0,2,3", help="ZeRO stages of part 1")
    ap.add_argument("--no-update", action="store_true", help="skip part 1 (update), run part 2 (rollouts) only")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "STAGE"))
    ap.add_argument("--fetch")
    ap.add_argument("--batches", type=int, default=3)
    args = ap.parse_args()
    if args.worker:
        return update_worker(args.worker[0], int(args.worker[1]), args.steps)
    if args.fetch:
        return fetch_worker(args.fetch, args.batches)
    print(f"{'model':>6} {'ZeRO':>4} {'ranks':>5} {'rank':>4} {'s/step':>7} {'param+optim MB':>14} {'peak RSS MB':>11}")
    for model in args.models.split(",") if not args.no_update else []:
        for stage in [int(s) for s in args.stages.split(",")]:
            for nproc in (1, 2):
                for line in torchrun(nproc, "--worker", model, str(stage), "--steps", str(args.steps)):
                    if line.startswith("ROW "):
                        r = json.loads(line[4:])
                        print(f"{r['model']:>6} {r['zero']:>4} {r['ranks']:>5} {r['rank']:>4} {r['step_s']:>7.2f} "
                              f"{r['held_mb']:>14.1f} {r['peak_rss_mb']:>11.0f}", flush=True)
    fetch = bench_fetch(args.batches)
    print(f"\nrollouts ({NUM_PROMPTS} prompts x {GROUP}, tiny default, 2 ranks, best of {args.batches}): "
          f"per-rank fetch {fetch['per_rank']:.2f} s, rank 0 fetch + scatter {fetch['rank0_scatter']:.2f} s "
          f"(ratio {fetch['rank0_scatter'] / fetch['per_rank']:.2f})")
    return None


if __name__ == "__main__":
    main()
