"""dlrl's LLaDA / Dream decoding is token- and step-identical to the official rollout functions of
Gen-Verse/dLLM-RL (`generate_with_prefix_cache`, Dream's `_sample`), whose outputs on small random
official-layout folders are tests/fixtures/official_full_decoding.json (the upstream commit, the settings and
the folder recipe inside; the official code is not part of dlrl). Greedy and seeded (rng="official": the
official torch draws), static and dynamic, exact and prefix cache with further_horizon, prompts of every
length 1..9 around blocks of 4 (and 3, 8, 13 around blocks of 8), all prompts of a case in ONE mixed batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dllm.embedded.full_folders import build_full_folder
from dllm.full.decoding import generate_full
from dllm.full.model import FullAttentionLM
from dllm.full.runner import FullRunner
from dllm.sampling import SamplingParams
from dllm.sequence import GenerationOutput

DATA = json.loads((Path(__file__).parents[1] / "fixtures" / "official_full_decoding.json").read_text())
CASES = sorted({(r["family"], r["case"]) for r in DATA["records"]})


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("official")
    out = {}
    for family, spec in DATA["folders"].items():
        out[family] = build_full_folder(root / family, family, seed=spec["seed"], init_std=spec["init_std"])
    return out


_models: dict[tuple[str, int], FullAttentionLM] = {}


def model_for(folders: dict[str, Path], family: str, block_size: int) -> FullAttentionLM:
    from dllm.weights import load_pretrained

    if (family, block_size) not in _models:
        m = load_pretrained(folders[family], block_size=block_size)
        assert isinstance(m, FullAttentionLM)
        _models[family, block_size] = m
    return _models[family, block_size]


def records(family: str, case: str) -> list[dict[str, Any]]:
    return [r for r in DATA["records"] if r["family"] == family and r["case"] == case]


def official_steps(step_map: list[int], block_size: int) -> list[int]:
    """The official step map (history index over the whole generation) -> dlrl's steps (1-based within the
    block): a block's first forward always commits one of its tokens, so its index is the block's smallest."""
    out = []
    for b in range(0, len(step_map), block_size):
        blk = step_map[b:b + block_size]
        out += [t - min(blk) + 1 for t in blk]
    return out


def decode(model: FullAttentionLM, recs: list[dict[str, Any]], rng: str = "official",
           stop_ids: list[int] | None = None) -> list[GenerationOutput]:
    c = recs[0]["settings"]
    params = [SamplingParams(max_tokens=c["gen_length"], temperature=c["temperature"], top_p=c["top_p"] or 1.0,
                             top_k=c["top_k"] or 0, strategy=c["strategy"], steps=c["steps"],
                             threshold=c["threshold"], seed=c["seed"], ignore_eos=stop_ids is None,
                             stop_token_ids=stop_ids) for _ in recs]
    return generate_full(model, [r["prompt_ids"] for r in recs], params, eos_ids=[],
                         cache_mode="prefix" if c["use_cache"] else "exact", further_horizon=c["further_horizon"],
                         pad_penalty=c["pad_penalty"], rng=rng)


@pytest.mark.parametrize(("family", "case"), CASES)
def test_mixed_batch_equals_the_official_function(folders: dict[str, Path], family: str, case: str) -> None:
    recs = records(family, case)
    B = recs[0]["settings"]["block_size"]
    assert len({len(r["prompt_ids"]) for r in recs}) == len(recs) > 2  # every prompt length, one batch
    outs = decode(model_for(folders, family, B), recs)
    for r, o in zip(recs, outs):
        assert o.completion_ids == r["token_ids"], (len(r["prompt_ids"]), o.completion_ids, r["token_ids"])
        assert o.trace.steps == official_steps(r["step_map"], B), (len(r["prompt_ids"]), o.trace.steps)
        assert o.trace.block_origin == len(r["prompt_ids"]) and o.trace.canvas_len == len(r["prompt_ids"]) + len(r["token_ids"])
        assert o.trace.num_forwards <= r["num_forwards"]  # forwards that commit nothing (Dream's k = 0) leave no step


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_completion_is_the_official_one_cut_at_its_first_stop_id(folders: dict[str, Path], family: str) -> None:
    recs = records(family, "greedy-static-prefix-h4")
    model = model_for(folders, family, 4)
    for r in recs:
        stop = r["token_ids"][5]  # a token of the second block: the sequence ends with the block holding it
        cut = r["token_ids"].index(stop) + 1
        (o,) = decode(model, [r], stop_ids=[stop])
        assert o.completion_ids == r["token_ids"][:cut] and o.finish_reason == "stop"
        end = -(-cut // 4) * 4
        assert o.trace.tail_ids == r["token_ids"][cut:end]
        assert o.trace.steps + o.trace.tail_steps == official_steps(r["step_map"], 4)[:end]


def test_one_sequence_alone_equals_it_in_a_batch(folders: dict[str, Path]) -> None:
    recs = records("dream", "seeded-static3-prefix-h4")
    model = model_for(folders, "dream", 4)
    alone = decode(model, recs[4:5])[0]
    assert alone.completion_ids == recs[4]["token_ids"]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_counter_noise_is_seeded_but_not_the_official_stream(folders: dict[str, Path], family: str) -> None:
    """rng="counter" (dlrl's default): the same distribution, another random stream -- reproducible, batch-invariant."""
    recs = records(family, "seeded-static-exact")
    model = model_for(folders, family, 4)
    a, b = decode(model, recs, rng="counter"), decode(model, recs[::-1], rng="counter")[::-1]
    assert [o.completion_ids for o in a] == [o.completion_ids for o in b]
    assert [o.completion_ids for o in a] != [r["token_ids"] for r in recs]


def test_dream_schedule_forwards_that_commit_nothing(folders: dict[str, Path]) -> None:
    """Steps 4 over a block of 4: Dream's schedule is [1, 0, 1, 2] -- the second forward commits nothing."""
    rec = records("dream", "greedy-static-exact")[0]
    steps = official_steps(rec["step_map"], 4)
    for b in range(0, 12, 4):
        assert sorted(steps[b:b + 4]) == [1, 3, 4, 4]
    dec = FullRunner(model_for(folders, "dream", 4), max_batch=1, eos_ids=[])
    assert dec.further_horizon is None  # exact mode: the whole canvas
    assert torch.__version__  # the data's torch: DATA["versions"]
