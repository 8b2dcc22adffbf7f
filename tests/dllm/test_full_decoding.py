"""Full-attention decoding (LLaDA, Dream) and its replay: exact mode replays the sampler's log-probabilities
(< 1e-4 fp32), the prefix cache's mismatch is measured, per-family rules, the step-by-step interface."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllm.decoding import Decoder, StepOutput, generate
from dllm.embedded.full_folders import build_full_folder
from dllm.errors import FieldError
from dllm.full.decoding import generate_full
from dllm.full.model import FullAttentionLM
from dllm.full.replay import build_full_rows, full_replay_hidden, full_trace_hidden
from dllm.full.runner import FullRunner
from dllm.full.sampler import sample_and_commit_full
from dllm.replay import token_logprobs
from dllm.sampling import SamplingParams
from dllm.sequence import GenerationOutput
from dllm.step import columns, padding_row
from dllm.strategy import Strategy
from dllm.trace import Trace
from tests.helpers import load_full_models

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14]]
CASES = {
    "greedy-static": SamplingParams(max_tokens=10, temperature=0, strategy="static", steps=2),
    "sampled-dynamic": SamplingParams(max_tokens=11, temperature=1.0, strategy="dynamic", threshold=0.05, seed=3),
    "sampled-static": SamplingParams(max_tokens=9, temperature=1.0, strategy="static", steps=3, seed=11),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FullAttentionLM]:
    return load_full_models(tmp_path_factory.mktemp("fulldec"))


def replay_diffs(model: FullAttentionLM, outs: list[GenerationOutput], shrink: int = 1) -> torch.Tensor:
    mask = model.config.mask_token_id
    rows = build_full_rows(outs, mask, 0, shrink=shrink)
    with torch.no_grad():
        lp = token_logprobs(model.lm_head(full_replay_hidden(model, rows)), rows.clean.to(model.device), mask).cpu()
    old = rows.gather([o.trace.logprobs for o in outs])
    assert int(rows.target.sum()) == sum(len(o.completion_ids) for o in outs)  # every token scored once
    return (lp - old)[rows.target].abs()


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_mode_replays_the_sampler(models: dict[str, FullAttentionLM], family: str, case: str) -> None:
    model = models[family]
    outs = generate_full(model, PROMPTS, CASES[case], cache_mode="exact", eos_ids=[])
    for o in outs:
        assert o.trace.cache_mode == "exact" and o.trace.canvas_len is not None
        P = len(o.prompt_ids)
        assert o.trace.block_origin == P and o.trace.canvas_len == P + -(-CASES[case].max_tokens // 4) * 4
        assert len(o.completion_ids) == CASES[case].max_tokens and o.finish_reason == "length"
        assert model.config.mask_token_id not in o.completion_ids
    assert replay_diffs(model, outs).max().item() < 1e-4


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_prefix_cache_mismatch_is_measured(models: dict[str, FullAttentionLM], family: str) -> None:
    model = models[family]
    diffs = []
    for case in ("greedy-static", "sampled-dynamic"):
        outs = generate_full(model, PROMPTS, CASES[case], cache_mode="prefix", eos_ids=[])
        assert all(o.trace.cache_mode == "prefix" for o in outs)
        diffs.append(replay_diffs(model, outs))
    d = torch.cat(diffs)
    assert torch.isfinite(d).all()
    print(f"\n{family} prefix cache: mean |replay - sampler logprob| = {d.mean():.2e}, max {d.max():.2e}")
    assert d.max().item() > 0  # the prefix cache is an approximation ...
    assert d.mean().item() < 0.5  # ... of the exact forward, not something else


def test_prefix_cache_needs_fewer_positions(models: dict[str, FullAttentionLM]) -> None:
    model = models["llada"]
    p = SamplingParams(max_tokens=12, temperature=0, strategy="static", steps=2)
    exact = generate_full(model, PROMPTS[:1], p, cache_mode="exact", eos_ids=[])
    prefix = generate_full(model, PROMPTS[:1], p, cache_mode="prefix", eos_ids=[])
    assert exact[0].num_forwards == prefix[0].num_forwards == 6  # 3 blocks (from the prompt's end) x 2 steps
    assert exact[0].completion_ids[:4] == prefix[0].completion_ids[:4]  # the first block's first forward is exact


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_shrink_merges_steps(models: dict[str, FullAttentionLM], family: str) -> None:
    outs = generate_full(models[family], PROMPTS, CASES["sampled-dynamic"], eos_ids=[])
    one = build_full_rows(outs, models[family].config.mask_token_id, 0, shrink=1)
    two = build_full_rows(outs, models[family].config.mask_token_id, 0, shrink=2)
    assert two.noisy.shape[0] < one.noisy.shape[0]
    assert int(two.target.sum()) == int(one.target.sum())
    for r in range(two.noisy.shape[0]):  # a row's targets are masked in its input
        assert (two.noisy[r][two.target[r]] == models[family].config.mask_token_id).all()


def test_dream_first_token_rule(models: dict[str, FullAttentionLM]) -> None:
    outs = generate_full(models["dream"], PROMPTS, CASES["sampled-dynamic"], eos_ids=[])
    for o in outs:
        steps = o.trace.steps + o.trace.tail_steps
        P = len(o.prompt_ids)
        by_block: dict[int, list[tuple[int, int]]] = {}
        for j, st in enumerate(steps):
            by_block.setdefault(o.trace.block_of(j), []).append((P + j, st))
        assert o.trace.block_of(0) == 0 and o.trace.block_of(4) == 1  # blocks start at the prompt's end
        for toks in by_block.values():
            first = min(toks)
            assert first[1] == 1 and [st for _, st in toks].count(1) == 1  # only the first position at step 1
    llada = generate_full(models["llada"], PROMPTS[:1], CASES["greedy-static"], eos_ids=[])
    assert llada[0].trace.steps[1:3] == [1, 1] or llada[0].trace.steps.count(1) > 3  # no such rule for LLaDA


def test_stop_ids_end_at_the_block_and_replay(models: dict[str, FullAttentionLM]) -> None:
    model = models["llada"]
    p = SamplingParams(max_tokens=16, temperature=0, strategy="static", steps=2)
    free = generate_full(model, PROMPTS[:1], p, eos_ids=[])[0]
    stop_id = free.completion_ids[4]
    out = generate_full(model, PROMPTS[:1], p, eos_ids=[stop_id])[0]
    assert out.finish_reason == "stop" and out.completion_ids[-1] == stop_id
    assert out.completion_ids == free.completion_ids[:free.completion_ids.index(stop_id) + 1]
    assert (len(out.completion_ids) + len(out.trace.tail_ids)) % 4 == 0  # blocks start at the prompt's end
    assert out.trace.canvas_len == free.trace.canvas_len
    assert replay_diffs(model, [out]).max().item() < 1e-4


@pytest.mark.parametrize("mode", ["exact", "prefix"])
def test_step_by_step_continuous_batching(models: dict[str, FullAttentionLM], mode: str) -> None:
    model = models["dream"]
    p = SamplingParams(max_tokens=8, temperature=1.0, strategy="static", steps=2, seed=5)
    alone = generate_full(model, PROMPTS[1:], p, cache_mode=mode, eos_ids=[])[0]
    dec = Decoder(FullRunner(model, max_batch=2, max_len=64, cache_mode=mode, eos_ids=[]))
    first = dec.runner.new_sequence(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0))
    dec.add([first])
    batch = dec.scheduler.schedule(version=0)  # the step by hand: schedule -> run -> postprocess
    out = dec.runner.run(batch)
    assert isinstance(out, StepOutput) and out.num_committed == 1 and out.outputs[0].ok
    dec.scheduler.postprocess(batch, out)
    late = dec.runner.new_sequence(PROMPTS[1], p)
    dec.add([late])
    dec.run()
    assert late.completion_ids == alone.completion_ids
    torch.testing.assert_close(torch.tensor(late.trace.logprobs), torch.tensor(alone.trace.logprobs), atol=1e-5,
                               rtol=0)
    assert dec.scheduler.num_free_slots == 2 and not dec.runner.states  # slots back, the runner's state dropped


def test_trace_fields_are_optional_on_the_wire(models: dict[str, FullAttentionLM]) -> None:
    out = generate_full(models["llada"], PROMPTS[:1], CASES["greedy-static"], cache_mode="prefix", eos_ids=[])[0]
    wire = out.trace.model_dump(mode="json")
    assert wire["cache_mode"] == "prefix" and wire["canvas_len"] == out.trace.canvas_len
    assert Trace.model_validate(wire) == out.trace
    old = {k: v for k, v in wire.items() if k not in ("cache_mode", "canvas_len")}
    assert Trace.model_validate(old).cache_mode is None


def test_generate_dispatches_and_trace_hidden(models: dict[str, FullAttentionLM]) -> None:
    model = models["dream"]
    outs = generate(model, PROMPTS, CASES["sampled-static"], eos_ids=[])
    assert outs[0].trace.cache_mode == "exact"
    hidden = full_trace_hidden(model, outs[1])
    lp = torch.log_softmax(model.lm_head(hidden).masked_fill(
        torch.arange(model.config.vocab_size) == model.config.mask_token_id, float("-inf")), -1)
    got = lp.gather(-1, torch.tensor(outs[1].completion_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(got, torch.tensor(outs[1].trace.logprobs), atol=1e-4, rtol=0)


def test_bad_input_names_the_field(models: dict[str, FullAttentionLM]) -> None:
    with pytest.raises(FieldError, match="cache_mode"):
        FullRunner(models["llada"], max_batch=1, cache_mode="fast")
    with pytest.raises(FieldError, match="pad_penalty"):
        FullRunner(models["llada"], max_batch=1, pad_penalty=0)
    dec = FullRunner(models["llada"], max_batch=1, max_len=32)
    with pytest.raises(FieldError, match="prompt_ids"):
        dec.new_sequence([1, models["llada"].config.mask_token_id], SamplingParams(max_tokens=4))
    with pytest.raises(FieldError, match="max_tokens"):
        dec.new_sequence([1, 2], SamplingParams(max_tokens=40))


def test_pad_penalty_lowers_pad_confidence() -> None:
    B, V, pad, mask = 2, 6, 0, 5
    logits = torch.full((1, B, V), -10.0)
    logits[0, 0, pad], logits[0, 1, 3] = 5.0, 3.0  # position 0 predicts pad surely, position 1 token 3 less so
    row = torch.tensor(padding_row(B, mask))[None]
    col = columns(B)
    row[0, col["k"]], row[0, col["strategy"]], row[0, col["greedy"]] = 1, Strategy.static.code, 1.0
    plain = sample_and_commit_full(logits.clone(), row, mask, False, family="dream", pad_id=pad)
    penal = sample_and_commit_full(logits.clone(), row, mask, False, family="dream", pad_id=pad, pad_penalty=1e6)
    assert plain[0, :B].tolist() == [pad, mask] and penal[0, :B].tolist() == [mask, 3]


def test_tiny_folder_builder_is_reproducible(tmp_path: Path) -> None:
    a = build_full_folder(tmp_path / "a", "dream", seed=1)
    b = build_full_folder(tmp_path / "b", "dream", seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention path of the full-attention "
                                                         "decoder and replay, bf16 decoding)")
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cuda_flex_exact_replay_and_bf16(tmp_path: Path, family: str) -> None:
    from dllm.full.load import load_full_pretrained

    folder = build_full_folder(tmp_path / family, family, hidden_size=64, num_attention_heads=4)  # head_dim 16: flex
    model = load_full_pretrained(folder, device="cuda", block_size=4)
    outs = generate_full(model, PROMPTS, CASES["sampled-dynamic"], cache_mode="exact", eos_ids=[])
    assert replay_diffs(model, outs).max().item() < 1e-4
    bf = load_full_pretrained(folder, device="cuda", dtype="bf16", block_size=4)
    for mode in ("exact", "prefix"):
        got = generate_full(bf, PROMPTS, CASES["sampled-static"], cache_mode=mode, eos_ids=[])
        assert all(len(o.completion_ids) == 9 and all(map(torch.isfinite, torch.tensor(o.trace.logprobs)))
                   for o in got)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_prefix_rows_see_what_the_forward_saw(tmp_path: Path, family: str) -> None:
    """Prefix cache with further_horizon: a block's later forwards saw [0, block end + horizon) only, and so do
    their replay rows (`valid`); what remains is the cache's staleness, which TIS / MIS correct (for Dream the
    window brings replay clearly closer to the sampler than the whole canvas would)."""
    import copy

    from dllm.weights import load_pretrained

    model = load_pretrained(build_full_folder(tmp_path / family, family, seed=3, init_std=0.1), block_size=4)
    assert isinstance(model, FullAttentionLM)
    prompts = [[1 + (i * 7 + j) % 80 for j in range(3 + i)] for i in range(4)]
    p = SamplingParams(max_tokens=16, temperature=1.0, strategy="static", steps=4, seed=1, ignore_eos=True)
    windowed, whole = [], []
    for h in (0, 4):
        outs = generate_full(model, prompts, p, cache_mode="prefix", further_horizon=h, eos_ids=[])
        assert all(o.trace.further_horizon == h for o in outs)
        rows = build_full_rows(outs, model.config.mask_token_id, 0)
        r = 0
        for o in outs:  # one row per (block, step) that committed tokens; steps >= 2 see the window
            P, L = len(o.prompt_ids), o.trace.canvas_len
            assert L is not None
            for b, step in sorted({(o.trace.block_of(j), st) for j, st in enumerate(o.trace.steps)}):
                want = L if step == 1 else min(P + 4 * (b + 1) + h, L)
                assert int(rows.valid[r].sum()) == want, (b, step)
                r += 1
        assert r == rows.valid.shape[0]
        windowed.append(replay_diffs(model, outs).mean())
        unwindowed = [copy.deepcopy(o) for o in outs]
        for o in unwindowed:
            o.trace.further_horizon = None
        whole.append(replay_diffs(model, unwindowed).mean())
    print(f"\n{family} prefix replay |diff| mean, horizon 0 / 4: windowed {windowed}, whole canvas {whole}")
    assert all(0 < w < 0.5 for w in windowed)  # still the cache's staleness: TIS / MIS have something to correct
    if family == "dream":  # its window hides much of the canvas from the block: closer than the whole canvas
        assert sum(windowed) < 0.9 * sum(whole)
