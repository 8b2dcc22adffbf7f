"""Tests for trainer.data.prompts: JSONL prompt loading, chat templating, resumable PromptSampler."""

import json

import pytest

from trainer.data.prompts import PromptSampler, format_prompt, load_prompts


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_default_fields_and_math500_style(tmp_path):
    f = _write(tmp_path / "a.jsonl", [{"question": "1+1?", "ground_truth_answer": 2},
                                      {"prompt": "2+2?", "answer": "4"}, "",
                                      {"problem": "x?", "solution": "...", "answer": r"\frac{1}{2}", "level": 3}])
    ex = load_prompts(f)
    assert [e["prompt"] for e in ex] == ["1+1?", "2+2?", "x?"]
    assert [e["answer"] for e in ex] == ["2", "4", r"\frac{1}{2}"]
    assert ex[2]["level"] == 3 and ex[2]["question_text"] == "x?"  # other fields kept


def test_custom_fields_template_and_limit(tmp_path):
    f = _write(tmp_path / "b.jsonl", [{"q": f"Q{i}", "gt": i, "tests": ["assert True"]} for i in range(5)])
    ex = load_prompts(f, prompt_field="q", answer_field="gt", prompt_template="Solve: {prompt}\nBox it.", limit=2)
    assert len(ex) == 2 and ex[1]["prompt"] == "Solve: Q1\nBox it." and ex[1]["answer"] == "1"
    code = load_prompts(f, prompt_field="q", require_answer=False)
    assert "answer" not in code[0] and code[0]["tests"] == ["assert True"]


class FakeTokenizer:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_chat_template(tmp_path):
    f = _write(tmp_path / "c.jsonl", [{"question": "hi", "answer": "x"}])
    ex = load_prompts(f, tokenizer=FakeTokenizer(), system_prompt="be brief")
    assert ex[0]["prompt"] == "<system>be brief<user>hi<assistant>"
    assert ex[0]["question_text"] == "hi"
    assert format_prompt("q", "{prompt}!", FakeTokenizer()) == "<user>q!<assistant>"


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    bad = _write(tmp_path / "bad.jsonl", [{"question": "a", "answer": "1"}, '{"question": "b", "answer": '])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: bad JSON"):
        load_prompts(bad)
    arr = _write(tmp_path / "arr.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"arr\.jsonl:1: expected a JSON object"):
        load_prompts(arr)
    no_answer = _write(tmp_path / "na.jsonl", [{"question": "a"}])
    with pytest.raises(ValueError, match=r"na\.jsonl:1: missing answer field 'ground_truth_answer' / 'answer'"):
        load_prompts(no_answer)
    with pytest.raises(ValueError, match="missing answer field 'gt'"):
        load_prompts(no_answer, answer_field="gt")
    with pytest.raises(ValueError, match="missing prompt field 'text'"):
        load_prompts(no_answer, prompt_field="text", require_answer=False)
    empty = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="no examples"):
        load_prompts(empty)


def test_sampler_epochs_cover_everything_and_are_seeded():
    examples = [{"i": i} for i in range(7)]
    s = PromptSampler(examples, batch_size=3, seed=5)
    seen = [e["i"] for _ in range(7) for e in s.next_batch()]  # 21 = exactly 3 epochs
    for epoch in range(3):
        assert sorted(seen[7 * epoch: 7 * epoch + 7]) == list(range(7))
    assert seen[:7] != seen[7:14] or seen[7:14] != seen[14:]  # epochs reshuffle
    again = PromptSampler(examples, batch_size=3, seed=5)
    assert [e["i"] for _ in range(7) for e in again.next_batch()] == seen
    other = PromptSampler(examples, batch_size=3, seed=6)
    assert [e["i"] for _ in range(7) for e in other.next_batch()] != seen
    plain = PromptSampler(examples, batch_size=4, shuffle=False)
    assert [e["i"] for e in plain.next_batch() + plain.next_batch()] == [0, 1, 2, 3, 4, 5, 6, 0]


def test_sampler_resume():
    examples = [{"i": i} for i in range(5)]
    s = PromptSampler(examples, batch_size=3, seed=1)
    it = iter(s)
    next(it), next(it)
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON round trip
    expected = [[e["i"] for e in s.next_batch()] for _ in range(4)]
    resumed = PromptSampler(examples, batch_size=3, seed=1)
    resumed.load_state_dict(state)
    assert [[e["i"] for e in resumed.next_batch()] for _ in range(4)] == expected
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(examples, batch_size=3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_examples"):
        PromptSampler(examples[:4], batch_size=3, seed=1).load_state_dict(state)


def test_sampler_errors():
    with pytest.raises(ValueError, match="no examples"):
        PromptSampler([], batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler([{}], batch_size=0)
