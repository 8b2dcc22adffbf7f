"""server.kv_admission=optimistic: the scheduler admits on the pages a sequence's next forward touches and
preempts the newest running sequences when the next blocks do not fit; a preempted sequence keeps its
tokens, steps and version, and every sequence ends with the tokens and trace of worst-case reservation."""

from __future__ import annotations

import asyncio
import random

import torch

from dllm.kv_cache import KVCache
from dllm.model import SDARForCausalLM
from dllm.sampling import SamplingParams
from server.engine.backends.native import NativeBackend
from server.engine.scheduler import Request, Scheduler
from server.engine.sequence import ServerSequence
from tests.helpers import tiny_config


def run_all(model: SDARForCausalLM, admission: str, pages: int,
            prefix_caching: bool = True) -> tuple[list[ServerSequence], int, int]:
    """8 requests through Scheduler + NativeBackend, one engine step at a time (as Engine's loop does);
    pause (no abort) after step 6 for 3 steps with a version bump -> (sequences, preemptions, max running)."""
    memory = pages * KVCache.bytes_per_token(model.config, torch.float32) * model.config.block_size
    backend = NativeBackend(model, None, max_batch=8, max_model_len=48, eos_ids=[0], kv_cache_memory=memory,
                            kv_admission=admission, prefix_caching=prefix_caching)
    sched = Scheduler(64, kv=backend.kv_budget, post=backend.postprocessor())
    rng, loop = random.Random(5), asyncio.new_event_loop()
    seqs = []
    for i in range(8):
        p = SamplingParams(max_tokens=32, temperature=rng.choice([0.0, 1.0]), seed=i, strategy="static", steps=2)
        seq = backend.new_sequence([rng.randrange(1, 62) for _ in range(rng.randint(1, 9))], p)
        p.max_tokens = rng.randint(2, 32) if i % 2 else 32  # the length it stops at (max_tokens: the limit)
        seqs.append(seq)
        sched.enqueue(Request(f"r{i}", [seq], loop))
    preempted = most = step = 0
    while not all(s.is_finished for s in seqs):
        step += 1
        paused = 6 < step <= 9
        batch = sched.schedule(paused=paused, version=1 if step > 9 else 0, now=float(step))
        preempted += len(batch.preempted)
        backend.release(batch.left)
        out = backend.run(batch)
        most = max(most, len(batch.running))
        for seq in sched.postprocess(batch, out, now=float(step)):
            sched.finish(seq)
        held = {p for s in sched.running for p in s.block_table}  # pages may be shared, never lost
        assert sched.blocks.num_used_pages == len(held) and sched.free_pages + len(held) == pages
    loop.close()
    return seqs, preempted, most


def test_optimistic_admission_preempts_and_keeps_exact_traces():
    torch.manual_seed(0)
    model = SDARForCausalLM(tiny_config(eos_token_id=0)).eval()
    reserve, none, most_reserve = run_all(model, "reserve", 24, prefix_caching=False)
    optimistic, preempted, most = run_all(model, "optimistic", 24)
    assert none == 0 and preempted > 0 and most > most_reserve
    for a, b in zip(optimistic, reserve, strict=True):
        assert a.completion_ids == b.completion_ids and a.trace.steps == b.trace.steps
        assert torch.allclose(torch.tensor(a.trace.logprobs), torch.tensor(b.trace.logprobs), atol=1e-5, rtol=0)
    assert {s.trace.version for s in optimistic} <= {0, 1}  # one version per sequence, kept across preemption


def test_preempted_sequences_count_as_in_flight_and_abort_with_the_running():
    """Scheduler alone (blocks of one token, one token per page): growing blocks preempt the newest; a
    preempted sequence keeps the engine from being drained, is re-admitted while paused (only it), and a
    pause with abort aborts it with the running ones, every page back."""
    from server.engine.scheduler import KVBudget
    from server.engine.sequence import SeqStatus

    loop = asyncio.new_event_loop()
    sched = Scheduler(8, kv=KVBudget(num_slots=4, num_pages=6, page_tokens=1, optimistic=True))
    seqs = [ServerSequence([7], SamplingParams(max_tokens=4), 1, 1) for _ in range(4)]
    for i, s in enumerate(seqs):
        sched.enqueue(Request(f"r{i}", [s], loop))
    batch = sched.schedule(paused=False, version=3, now=0.0)
    assert batch.admitted == seqs[:3] and sched.free_pages == 0  # 2 pages each: prompt + the block (unshared)
    for s in batch.running:
        s.block_done = True  # each now needs one page more
    batch = sched.schedule(paused=True, version=4, now=1.0)
    assert batch.preempted == [seqs[2]] and batch.admitted == [] and seqs[2].status is SeqStatus.WAITING
    assert not sched.is_idle and sched.has_work(is_paused=True) and sched.waiting[0] is seqs[2]
    assert seqs[2].trace.version == 3  # kept: re-admission does not stamp a new version
    sched.abort_running()
    released = sched.schedule(paused=True, version=4, now=2.0).released
    assert set(map(id, released)) == {id(s) for s in seqs[:3]}
    for s in released:
        sched.finish(s)
    assert sched.is_idle and sched.free_pages == 6 and [s.status for s in sched.waiting] == [SeqStatus.WAITING]
    loop.close()
