"""The static decode step (dllm/step.py, run by dllm.runner.BlockRunner over typed inputs): the previous
engines' tokens, steps and logprobs through bucketed shapes, zero recompiles over a mixed workload,
weights pushed under a compiled step, and (on CUDA only) captured graphs replayed."""

import random
import subprocess
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from benchmarks.oldref import load_package
from dllm.decoding import generate
from dllm.model import SDARForCausalLM
from dllm.replay import build_rows, token_logprobs
from dllm.runner import BlockRunner
from dllm.sampling import SamplingParams
from dllm.step import buckets
from dllm.weights import copy_into_model
from tests.helpers import drive, tiny_config, watch_recompiles

PREVIOUS = "2bdf442"  # main before the static step: the engine it must reproduce
BEFORE_BLOCK_MANAGER = "1cd46a0"  # main before the block manager and the typed step (issue 43)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SDARForCausalLM(tiny_config(eos_token_id=0)).eval()


def mixed_requests(rng: random.Random, n: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1..11 tokens (one-block and multi-block prompts) with every strategy and sampler."""
    out = []
    for _ in range(n):
        strategy = rng.choice(["static", "dynamic", "sequential"])
        params = SamplingParams(max_tokens=rng.randint(1, 14), temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
                                top_k=rng.choice([0, 0, 5]), top_p=rng.choice([1.0, 1.0, 0.8]), strategy=strategy,
                                steps=rng.choice([None, 2, 4]), threshold=rng.choice([0.05, 0.3, 0.9]),
                                seed=rng.randrange(1 << 30), ignore_eos=rng.random() < 0.5)
        out.append(([rng.randrange(1, 63) for _ in range(rng.randint(1, 11))], params))
    return out


def drive_old(dec, requests, admit_per_step: int = 2):
    """The previous engines' continuous batching (their BlockDecoder kept its own slots and pages)."""
    seqs = [dec.new_sequence(p, q) for p, q in requests]
    waiting, running = list(seqs), []
    while waiting or running:
        admit = waiting[:min(admit_per_step, dec.num_admissible(waiting))]
        dec.add(admit)
        waiting, running = waiting[len(admit):], running + admit
        dec.step(running)
        running = [s for s in running if not s.is_finished]
    return seqs


def same_outputs(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        assert x.trace.steps == y.trace.steps and x.trace.tail_ids == y.trace.tail_ids
        assert torch.allclose(torch.tensor(x.trace.logprobs), torch.tensor(y.trace.logprobs), atol=1e-5, rtol=0)


def old_engine(ref: str, model):
    """dllm as it was at `ref` and a copy of `model` for it (skips in a shallow clone that lacks the ref)."""
    has_ref = subprocess.run(["git", "cat-file", "-e", f"{ref}^{{commit}}"], cwd=Path(__file__).parent,
                             capture_output=True).returncode == 0
    if not has_ref:  # only a shallow clone lacks it (CI and developers clone the whole history)
        pytest.skip(f"needs commit {ref} of this repository's history (a shallow clone)")
    old = load_package("dllm", ref)
    old_model = old.model.SDARForCausalLM(old.config.SDARConfig.from_dict(model.config.to_dict())).eval()
    old_model.load_state_dict(dict(model.hf_named_tensors()), strict=not model.config.tie_word_embeddings)
    return old, old_model


@pytest.mark.parametrize("ref", [PREVIOUS, BEFORE_BLOCK_MANAGER])
def test_static_step_reproduces_the_previous_engines(model, ref):
    """The float64-row step (2bdf442) and the engine before the block manager (1cd46a0): same tokens, steps,
    logprobs, for whole batches and under continuous batching (sharing on: these prompts share no block)."""
    old, old_model = old_engine(ref, model)
    rng = random.Random(0)
    for trial in range(4):  # whole batches of 1..9 sequences (rows padded to 1, 2, 4, 8, 16) ...
        requests = mixed_requests(rng, [1, 3, 6, 9][trial])
        plist = [q for _, q in requests]
        same_outputs(generate(model, [p for p, _ in requests], plist),
                     old.decoding.generate(old_model, [p for p, _ in requests], plist))
    for admit in (1, 3):  # ... and continuous batching: sequences join and leave a running batch
        requests = mixed_requests(rng, 10)
        new = drive(BlockRunner(model, max_batch=6, max_len=40, eos_ids=[0], num_pages=40), requests, admit)
        prev = drive_old(old.decoding.BlockDecoder(old_model, max_batch=6, max_len=40, eos_ids=[0], num_pages=40),
                         requests, admit)
        same_outputs(new, prev)


def test_buckets_are_bounded():
    assert buckets(1) == [1] and buckets(12) == [1, 2, 4, 8, 12] and buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    runner = BlockRunner(SDARForCausalLM(tiny_config()), max_batch=5, max_len=100, num_pages=30)
    assert runner.row_buckets == [1, 2, 4, 8, 10]  # sequences + the clean blocks they owe the cache
    assert runner.kv_buckets == [4, 8, 16, 32, 64, 128]  # page-aligned powers of two, past max_len=100
    assert runner.bucket(3, 17) == (4, 32)


def test_step_results_read_back_as_bytes_equal_the_lists():
    """The CUDA read-back (one copy of every result as bytes, dllm.step_inputs.as_bytes / from_bytes) gives
    what the CPU path's lists give (run here on CPU tensors)."""
    from dllm.step import StepResult
    from dllm.step_inputs import as_bytes, from_bytes, read_back

    g = torch.Generator().manual_seed(0)
    res = StepResult(torch.randint(0, 151936, (6, 4), generator=g), torch.randn(6, 4, generator=g),
                     torch.rand(6, 4, generator=g) > 0.5, torch.tensor([True, False, True, True, False, True]))
    assert from_bytes(as_bytes(res, 5).numpy(), 4) == read_back(res, 5)


def test_zero_recompiles_over_a_mixed_workload(model):
    """After a warm-up that meets each variant once (1 row or more, 1 sampled row or more, top-k / top-p
    used or not),
    any batch size, prompt length, strategy, temperature and key length reuses the compiled step."""
    dec = BlockRunner(model, max_batch=8, max_len=64, eos_ids=[0], num_pages=64, compile="eager", static_shapes=False)
    warm = [([5], SamplingParams(max_tokens=6, seed=1, ignore_eos=True)),
            ([5, 6], SamplingParams(max_tokens=6, top_k=3, seed=1, ignore_eos=True))]
    for requests in ([warm[0]], [warm[1]], warm * 2, [(warm[1][0], warm[0][1])] * 3):
        drive(dec, requests)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 6  # the warm-up compiled the six variants (1 row or more, 1 sampled or more, filtered or not)
    with watch_recompiles() as events:
        for seed, admit in [(1, 1), (2, 3), (3, 8)]:
            done = drive(dec, mixed_requests(random.Random(seed), 14), admit)
            assert all(s.finish_reason in ("stop", "length") for s in done)
        assert counters["stats"]["unique_graphs"] == graphs and events.messages == []
        other = BlockRunner(model, max_batch=2, max_len=64, num_pages=20, compile="eager",
                            static_shapes=False)  # another pool shape
        drive(other, [warm[0]])
        assert events.messages and "kv" in events.messages[0]  # the handler does hear recompiles


def test_weights_pushed_under_the_compiled_step(model):
    """Inductor-compiled step: weights copied in place (as weight sync does) change the outputs to
    exactly a fresh model's with those weights, with no recompilation; traces still replay (< 1e-4)."""
    torch.manual_seed(1)
    pushed = SDARForCausalLM(tiny_config(eos_token_id=0)).eval()
    served = SDARForCausalLM(tiny_config(eos_token_id=0)).eval()
    served.load_state_dict(model.state_dict())
    dec = BlockRunner(served, max_batch=2, max_len=32, eos_ids=[0], num_pages=16, compile=True,
                      static_shapes=False)  # one dynamic graph: few inductor compiles on a CPU
    prompts = [([1, 2, 3, 4, 5], SamplingParams(max_tokens=7, seed=4, strategy="static", steps=2)),
               ([6, 7], SamplingParams(max_tokens=6, seed=5, temperature=0.0, strategy="dynamic", threshold=0.3))]
    same_outputs(drive(dec, prompts), drive(BlockRunner(model, max_batch=2, max_len=32, eos_ids=[0]), prompts))
    graphs = counters["stats"]["unique_graphs"]
    copy_into_model(served, list(pushed.hf_named_tensors()))
    after = drive(dec, prompts)
    same_outputs(after, drive(BlockRunner(pushed, max_batch=2, max_len=32, eos_ids=[0]), prompts))
    assert counters["stats"]["unique_graphs"] == graphs
    rows = build_rows(after, 4, served.config.mask_token_id, pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(pushed.forward_train(rows.noisy, rows.clean, rows.pos, rows.valid), rows.clean,
                            served.config.mask_token_id)
    assert (lp - rows.gather([s.trace.logprobs for s in after]))[rows.target].abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
def test_cuda_graphs_replay_each_bucket_and_survive_weight_pushes(model):
    torch.manual_seed(1)
    pushed = SDARForCausalLM(tiny_config(eos_token_id=0)).cuda().eval()
    served = SDARForCausalLM(tiny_config(eos_token_id=0)).cuda().eval()
    served.load_state_dict(model.state_dict())
    requests = mixed_requests(random.Random(7), 8)
    graphed = BlockRunner(served, max_batch=4, max_len=40, eos_ids=[0], num_pages=40, cuda_graphs=True)
    eager = BlockRunner(served, max_batch=4, max_len=40, eos_ids=[0], num_pages=40)
    same_outputs(drive(graphed, requests), drive(eager, requests))
    assert graphed.graphs is not None
    num_graphs = len(graphed.graphs.graphs)
    assert 1 <= num_graphs <= len(graphed.row_buckets) ** 2 * len(graphed.kv_buckets) * 2
    copy_into_model(served, list(pushed.hf_named_tensors()))
    fresh = BlockRunner(pushed, max_batch=4, max_len=40, eos_ids=[0], num_pages=40)
    same_outputs(drive(graphed, requests), drive(fresh, requests))
    assert len(graphed.graphs.graphs) == num_graphs  # the pushed weights replayed through the same graphs
