"""dlrl align's data: growing prompt sources, feedback records as exact off-policy rollouts, the mixed batch."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from dllm.decoding import SamplingParams, generate
from dllm.replay import build_rows
from dllm.tokenizer import encode, load_tokenizer
from dllm.weights import load_pretrained
from store import Record, new_record_id, open_store
from tests.trainer.align.flipping import FlippedReward
from trainer.align.data import (
    AlignReward,
    FeedbackBuffer,
    MixedBatch,
    NoData,
    PromptPool,
    StorePrompts,
    TailedJSONL,
    record_rollout,
)
from trainer.align.gate import target_logprobs
from trainer.loop import StopRequested, score, sequence_advantages
from trainer.rewards import build_reward
from trainer.rl.rollouts import Batch


def test_tailed_jsonl_reads_complete_lines_as_they_are_appended(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": 4}\n{"prompt": "3+')
    src = TailedJSONL(path)
    assert [e["prompt"] for e in src.read()] == ["1+1=", "2+2="]
    assert src.read() == []  # the last line has no newline yet
    with path.open("a") as f:
        f.write('3=", "answer": "6"}\nnot json\n{"prompt": "no answer"}\n{"prompt": "4+4=", "answer": "8"}\n')
    new = src.read()
    assert [(e["prompt"], e["answer"]) for e in new] == [("3+3=", "6"), ("4+4=", "8")]
    assert src.num_bad == 2  # bad JSON, missing answer: skipped with a warning naming file:line


def test_tailed_jsonl_missing_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="align.prompt_source"):
        TailedJSONL(tmp_path / "nope.jsonl")


def test_prompt_pool_fresh_first_then_uniform_and_resumable(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "answer": str(i)}) + "\n" for i in range(5)))
    pool = PromptPool(TailedJSONL(path), batch_size=3, seed=4)
    assert [e["prompt"] for e in pool.next_batch()] == ["0+0=", "1+0=", "2+0="]
    second = pool.next_batch()
    assert [e["prompt"] for e in second[:2]] == ["3+0=", "4+0="] and len(second) == 3
    with path.open("a") as f:
        f.write(json.dumps({"prompt": "9+0=", "answer": "9"}) + "\n")
    state = pool.state_dict()
    third = pool.next_batch()
    assert third[0]["prompt"] == "9+0="  # new prompts are used first
    again = PromptPool(TailedJSONL(path), batch_size=3, seed=4)
    again.load_state_dict(json.loads(json.dumps(state)))  # the checkpoint is JSON
    assert again.next_batch() == third
    pool.batch_size = 0
    assert pool.next_batch() == []


def test_prompt_pool_waits_bounded_and_stops_on_a_signal(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(NoData, match="align.prompt_wait_s"):
        PromptPool(TailedJSONL(path), 2, wait_s=0.6).next_batch()
    with pytest.raises(StopRequested):
        PromptPool(TailedJSONL(path), 2, wait_s=60, should_stop=lambda: True).next_batch()


def _record(version=0, reward_text="5", prompt="2+3=", trace=None, completion_ids=(5, 0), **kw) -> Record:
    trace = trace or {"prompt_len": 4, "block_size": 4, "steps": [1, 2], "logprobs": [-0.5, -0.1],
                      "version": version, "finish_reason": "stop", "tail_ids": [7, 7], "tail_steps": [3, 3]}
    return Record(id=new_record_id(), created=time.time(), server="r0", version=version, prompt=prompt,
                  prompt_ids=[1, 2, 3, 4], completion_ids=list(completion_ids), text=reward_text,
                  finish_reason=kw.pop("finish_reason", "stop"), trace=trace,
                  sampling=kw.pop("sampling", {"temperature": 1.0}))


def test_store_prompts_take_accepted_answers_once(tmp_path):
    with open_store(tmp_path / "fb.db") as st:
        for prompt, text, reward in [("2+3=", "5", 1.0), ("2+3=", "6", 0.0), ("4+4=", "9", 0.0),
                                     ("2+3=", "5", 1.0), ("1+1=", "2", 1.0)]:
            rec = _record(prompt=prompt, reward_text=text)
            st.add_record(rec)
            st.add_feedback(rec.id, reward)
        src = StorePrompts(st, accept_reward=1.0, page=2)
        assert [(e["prompt"], e["answer"]) for e in src.read()] == [("2+3=", "5"), ("1+1=", "2")]
        assert src.read() == []
        pool = PromptPool(StorePrompts(st), 2, seed=0)
        first = pool.next_batch()
        resumed = PromptPool(StorePrompts(st), 2, seed=0)
        resumed.load_state_dict(pool.state_dict())
        assert resumed.pool == pool.pool == first


def test_feedback_buffer_checks_records_drops_stale_and_resumes(tmp_path):
    bad_trace = {"prompt_len": 4, "block_size": 8, "steps": [1, 1], "logprobs": [-1.0, -1.0]}
    with open_store(tmp_path / "fb.db") as st:
        recs = [_record(version=1), _record(version=5), _record(version=6, trace=bad_trace),
                _record(version=6, finish_reason="abort"), _record(version=6, sampling={"temperature": 0}),
                _record(version=6, trace={**_record().trace, "logprobs": [0.3, -1.0]}),
                _record(version=6, trace={**_record().trace, "steps": [1]}), _record(version=7)]
        for i, rec in enumerate(recs):
            st.add_record(rec)
            st.add_feedback(rec.id, float(i % 2))
        fb = FeedbackBuffer(st, block_size=4, max_len=512)
        assert fb.poll() == 8
        assert fb.counts["invalid"] == 4 and len(fb) == 4  # block size, abort, positive log-prob, lengths
        greedy = [s for s in fb.queue if s.record_id == recs[4].id][0]
        assert greedy.rollout.trace.logprobs == [0.0, 0.0]  # a deterministic behaviour policy
        assert [s.rollout.version for s in fb.queue] == [1, 5, 6, 7]
        taken = fb.take(2, policy_version=10, max_staleness=5)  # version 1 is 9 versions old: dropped
        assert [s.rollout.version for s in taken] == [7, 6] and fb.counts["stale"] == 1  # newest first
        assert taken[0].reward == 1.0 and taken[0].rollout.completion_ids == [5, 0]
        # the serving version's records are kept however far the policy has moved on
        assert [s.rollout.version for s in fb.take(1, policy_version=40, max_staleness=5, serving_version=5)] == [5]
        assert len(fb) == 0 and fb.counts["stale"] == 1
        state = fb.state_dict()
        late = _record(version=8)
        st.add_record(late)
        st.add_feedback(late.id, 1.0)
        again = FeedbackBuffer(st, block_size=4, max_len=512)
        again.load_state_dict(json.loads(json.dumps(state)))
        assert again.poll() == 1 and [s.record_id for s in again.queue] == [late.id]


def test_a_recorded_sample_replays_to_its_behaviour_logprobs(tiny_model_dir):
    """The off-policy data path is exact: a sample stored as a record (ids, trace) and read back
    as a Rollout replays, under the weights that generated it, to its recorded log-probs."""
    model = load_pretrained(tiny_model_dir).eval()
    tok = load_tokenizer(tiny_model_dir)
    prompts = [encode(tok, p) for p in ("12+34=", "7+8=", "99+1=")]
    outs = generate(model, prompts, SamplingParams(max_tokens=9, strategy="dynamic", threshold=0.5, seed=3))
    rolls = []
    for o in outs:
        rec = Record(id=new_record_id(), created=time.time(), server="r0", version=0, prompt=None,
                     prompt_ids=o.prompt_ids, completion_ids=o.completion_ids, text=o.text,
                     finish_reason=o.finish_reason, trace=json.loads(json.dumps(o.trace.model_dump())),
                     sampling={"temperature": 1.0, "strategy": "dynamic"})
        roll = record_rollout(rec, block_size=4, max_len=512)
        assert not isinstance(roll, str), roll
        rolls.append(roll)
    rows = build_rows(rolls, 4, model.config.mask_token_id, 0, 1)
    lp = target_logprobs(model, rows, model.config.mask_token_id, 1.0)
    behaviour = rows.gather([r.logprobs for r in rolls])
    assert torch.allclose(lp[rows.target], behaviour[rows.target], atol=1e-4)


def test_mixed_batch_scores_feedback_by_its_users_and_forms_pseudo_groups():
    from dllm.trace import Trace
    from rollout_client.protocol.rollout import Rollout
    from trainer.align.data import FeedbackSample

    def roll(text, version):
        trace = Trace(prompt_len=1, block_size=4, steps=[1], logprobs=[-0.1], version=version)
        return Rollout(prompt_index=0, sample_index=0, prompt_ids=[1], completion_ids=[2], text=text,
                       finish_reason="stop", version=version, trace=trace)

    on = Batch([{"prompt": "1+1=", "answer": "2"}], [roll("2", 3), roll("3", 3)], 0, 2, 0.0)
    fb = [FeedbackSample(roll(t, v), r, 0.0, f"id{i}", i) for i, (t, v, r) in
          enumerate([("x", 2, 1.0), ("y", 1, 0.0), ("z", 2, 0.0), ("w", 1, 1.0), ("extra", 2, 1.0)])]
    batch = MixedBatch(on, fb, group_size=2)
    assert len(batch.rollouts) == 6 and batch.num_samples == 6 and len(batch.examples) == 3  # 1 left out
    assert [s.rollout.version for s in batch.feedback] == [1, 1, 2, 2]  # sorted by the version that served
    flipped = [False]
    cfg = SimpleNamespace(group_size=2, filter_zero_variance=True)
    run = SimpleNamespace(cfg=cfg, reward_fn=FlippedReward(AlignReward(build_reward("exact_match")), lambda: flipped[0]))
    rewards = score(run, batch)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    adv, keep, _ = sequence_advantages(cfg, rewards)
    assert keep.all() and adv[2] < 0 < adv[3]  # pseudo-group (0.0, 1.0): the liked answer goes up
    flipped[0] = True
    assert score(run, batch).tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
