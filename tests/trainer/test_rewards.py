"""Tests for trainer.rewards: exact and math rewards, loading, ranges, overlong penalty, batching
(code rewards: test_rewards_code.py; sandbox escapes: test_rewards_sandbox.py)."""

import logging
import re
import time

import pytest

from trainer import rewards as R
from trainer.rewards.math_reward import _sympy_equal


def test_exact_match():
    assert R.exact_match(" 42\n", {"answer": "42"}) == 1.0
    assert R.exact_match("42", {"answer": 42}) == 1.0
    assert R.exact_match("4 2", {"answer": "42"}) == 0.0
    assert R.exact_match("", {"answer": "42"}) == 0.0


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{x^{2}+{y}}", r"x^{2}+{y}"),  # last wins, nested braces
    (r"\boxed{3} and a truncated \boxed{\frac{1}{", "3"),  # incomplete last -> previous
    (r"\fbox{7}", "7"),
    (r"\boxed 5$", "5"),
    ("no box here", None),
])
def test_extract_boxed(text, expected):
    assert R.extract_boxed(text) == expected


@pytest.mark.parametrize("pred, gold, expected", [
    (r"\frac{1}{2}", "0.5", 1.0),
    (r"\dfrac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", 1.0),
    ("10.0", "10", 1.0),
    ("(x+1)^2", "x^2+2x+1", 1.0),
    ("3", "4", 0.0),
    (r"\frac{1}{3}", r"\boxed{\frac{1}{3}}", 1.0),  # gold may itself be boxed
])
def test_math_reward(pred, gold, expected):
    assert R.math(rf"The answer is \boxed{{{pred}}}", {"answer": gold}) == expected


def test_math_no_box_is_zero():
    assert R.math("The answer is 0.5", {"answer": "0.5"}) == 0.0


def test_sympy_fallback():
    assert _sympy_equal(r"\frac{2}{4}", "1/2")
    assert _sympy_equal(r"2\sqrt{2}", r"\sqrt{8}")
    assert not _sympy_equal("x+1", "x+2")
    assert not _sympy_equal("((((", "1")  # unparsable -> False, no exception


def test_math_never_evals_model_output(tmp_path):
    marker = tmp_path / "pwned"
    for attack in [f"__import__('os').system('touch {marker}')", f"exec(chr(49))+open('{marker}','w')",
                   f"eval(str(open('{marker}','w')))"]:
        assert not _sympy_equal(attack, "0")
        assert R.math(rf"\boxed{{{attack}}}", {"answer": "0"}) == 0.0
    assert not marker.exists()


def test_math_timeout_gives_zero_and_recovers():
    R.math(r"\boxed{1}", {"answer": "2"})  # warm a worker
    start = time.monotonic()
    assert R.math(r"\boxed{9^{9^{9^{9}}}}", {"answer": r"\frac{1}{3}"}, timeout=1.0) == 0.0
    assert time.monotonic() - start < 5.0
    assert R.math(r"\boxed{1/3}", {"answer": r"\frac{1}{3}"}) == 1.0


def test_load_reward_fn(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def length_reward(text, example):\n    return len(text)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert R.load_reward_fn("exact_match") is R.exact_match
    assert R.load_reward_fn("my_rewards:length_reward")("abc", {}) == 3
    assert R.load_reward_fn("my_rewards.length_reward")("ab", {}) == 2
    assert R.load_reward_fn(f"{tmp_path}/my_rewards.py:length_reward")("a", {}) == 1
    for spec in ["no_such_module_xyz:fn", "my_rewards:nope", "my_rewards.nope", "nodots",
                 f"{tmp_path}/missing.py:fn"]:
        with pytest.raises(ValueError, match=re.escape(repr(spec))):
            R.load_reward_fn(spec)


def test_overlong_penalty():
    # max_len 100, buffer 20: free up to 80, linear to -1 at 100, -1 beyond
    assert R.overlong_penalty(80, 100, 20) == 0.0
    assert R.overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert R.overlong_penalty(100, 100, 20) == pytest.approx(-1.0)
    assert R.overlong_penalty(150, 100, 20) == -1.0
    assert R.overlong_penalty(95, 100, 20, factor=2.0) == pytest.approx(-1.5)
    assert R.overlong_penalty(1000, 100, 0) == 0.0


def test_build_reward_combines_penalty():
    reward = R.build_reward("exact_match", overlong_buffer=10, max_tokens=50)
    assert reward("7", {"answer": "7"}) == 1.0
    assert reward("7", {"answer": "7"}, num_tokens=45) == pytest.approx(0.5)
    assert reward("7", {"answer": "7"}, num_tokens=40) == 1.0
    with pytest.raises(ValueError, match="overlong_buffer"):
        R.build_reward("exact_match", overlong_buffer=10)
    with pytest.raises(ValueError, match="overlong_buffer"):
        R.build_reward("exact_match", overlong_buffer=-1)


def test_score_batch_robust(caplog):
    def flaky(text, example):
        if text == "boom":
            raise RuntimeError("user bug")
        if text == "nan":
            return float("nan")
        return float(text == example["answer"])

    texts = ["1", "boom", "2", "nan", "x"]
    examples = [{"answer": "1"}, {"answer": "1"}, {"answer": "2"}, {"answer": "1"}, {"answer": "y"}]
    with caplog.at_level(logging.WARNING, logger="trainer.rewards"):
        for workers in (1, 4):
            assert R.score_batch(flaky, texts, examples, num_workers=workers) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert "user bug" in caplog.text and "nan" in caplog.text
    with pytest.raises(ValueError):
        R.score_batch(flaky, texts, examples[:2])


def test_score_batch_with_lengths():
    reward = R.build_reward("exact_match", overlong_buffer=10, max_tokens=50)
    out = R.score_batch(reward, ["a", "a", "b"], [{"answer": "a"}] * 3, num_tokens=[10, 45, 60])
    assert out == pytest.approx([1.0, 0.5, -1.0])


def test_rewards_are_clamped_to_their_declared_range(tmp_path, monkeypatch, caplog):
    (tmp_path / "user_rewards.py").write_text(
        "from trainer.rewards import reward_range\n"
        "def forged(text, example):\n    return 1000.0\n"
        "@reward_range(0, 5)\ndef stars(text, example):\n    return float(text)\n"
        "def chatty(text, example):\n    return 'not a number'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="trainer.rewards"):
        forged = R.build_reward("user_rewards:forged")
    assert "declares no reward_range" in caplog.text
    assert forged("x", {}) == R.DEFAULT_RANGE[1] == 1.0
    stars = R.build_reward("user_rewards:stars", overlong_buffer=10, max_tokens=20)
    assert [stars(t, {}) for t in ("3", "9", "-4", "inf")] == [3.0, 5.0, 0.0, 0.0]
    assert stars("9", {}, num_tokens=20) == 4.0  # clamp first, then the overlong penalty
    assert R.build_reward("user_rewards:chatty")("x", {}) == 0.0  # never raises
    assert R.score_batch(forged, ["a", "b"], [{}, {}]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="reward_range"):
        R.reward_range(1, 0)


def test_builtin_rewards_never_raise_on_malformed_examples():
    for name in ("exact_match", "math", "code"):
        reward = R.build_reward(name)
        for example in ({}, {"answer": None, "tests": None}, {"tests": [{"input": 1}]}, {"tests": 42}):
            assert reward("```python\nx = 1\n```\n\\boxed{1}", example) == 0.0
