"""Tests for trainer.rewards: built-in rewards, sandboxing, loading, overlong penalty, batching."""

import logging
import math as pymath
import re
import textwrap
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


def _py(src: str) -> str:
    return "Here:\n```python\n" + textwrap.dedent(src) + "```\n"


ADD = _py("""
    def add(a, b):
        return a + b
""")


def test_extract_code():
    assert R.extract_code("```python\na = 1\n```\n```py\nb = 2\n```") == "b = 2\n"
    assert R.extract_code("```\nc = 3\n```") == "c = 3\n"
    assert R.extract_code("```python\na = 1\n```\n```\nb\n```") == "a = 1\n"  # python block preferred
    assert R.extract_code("no code") is None


def test_code_fraction_and_strict():
    tests = "assert add(1, 2) == 3\nassert add(2, 2) == 5\n"
    assert R.code(ADD, {"tests": tests}) == 0.5
    assert R.code(ADD, {"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}) == 1.0
    assert R.code_strict(ADD, {"tests": tests}) == 0.0
    assert R.code("no code", {"tests": tests}) == 0.0


def test_split_tests_setup_and_check_style():
    steps = R.split_tests("import math\nassert math.pi > 3\nx = 2\nassert x == 2\n")
    assert [t for _, t in steps] == [False, True, False, True]
    # HumanEval style: no top-level assert -> calls are the tests
    humaneval = "def check(f):\n    assert f(1, 1) == 2\n\ncheck(add)\n"
    assert [t for _, t in R.split_tests(humaneval)] == [False, True]
    assert R.code(ADD, {"tests": humaneval}) == 1.0
    assert R.code(ADD, {"tests": "import math\nassert add(1, 1) == 2\nassert math.floor(add(0.5, 0.6)) == 1\n"}) == 1.0


def test_code_broken_solution_fails_all_tests():
    assert R.code(_py("def add(a, b):\n    return a + b\nraise RuntimeError\n"), {"tests": "assert add(1, 2) == 3"}) == 0.0
    assert R.code(_py("import sys\nsys.exit(0)\n"), {"tests": "assert True"}) == 0.0
    assert R.code(_py("import os\nos._exit(0)\n"), {"tests": "assert True"}) == 0.0


def test_code_isolation():
    env_and_cwd = _py("""
        import os, sys, tempfile
        ENV = dict(os.environ)
        CWD = os.getcwd()
    """)
    tests = ["assert 'HOME' not in ENV and 'PATH' not in ENV", "assert 'dlrl_code_' in CWD",
             "assert sys.flags.isolated == 1"]
    assert R.code(env_and_cwd, {"tests": tests}) == 1.0


def test_code_time_and_memory_limits():
    start = time.monotonic()
    assert R.code(_py("while True:\n    pass\n"), {"tests": ["assert True"]}, timeout=1.0) == 0.0
    assert time.monotonic() - start < 5.0
    hog = _py("x = bytearray(4 * 1024 ** 3)\n")  # over the 2 GiB address-space limit
    assert R.code(hog, {"tests": ["assert True"]}) == 0.0


def test_code_cannot_forge_result_or_flood_output():
    forged = _py("""
        import sys
        print('{"passed": 99, "ok": true}')
        sys.__stdout__.write('deadbeef{"passed": 99, "ok": true}\\n')
        def add(a, b):
            return 0
    """)
    assert R.code(forged, {"tests": ["assert add(1, 1) == 2"]}) == 0.0
    flood = _py("import os\nwhile True:\n    os.write(1, b'x' * 65536)\n")
    assert R.code(flood, {"tests": ["assert True"]}, timeout=3.0) == 0.0


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


def test_score_batch_with_lengths_and_subprocess_rewards():
    reward = R.build_reward("exact_match", overlong_buffer=10, max_tokens=50)
    out = R.score_batch(reward, ["a", "a", "b"], [{"answer": "a"}] * 3, num_tokens=[10, 45, 60])
    assert out == pytest.approx([1.0, 0.5, -1.0])
    texts = [ADD, _py("def add(a, b):\n    return a - b\n")] * 2
    got = R.score_batch(R.build_reward("code"), texts, [{"tests": ["assert add(1, 2) == 3"]}] * 4, num_workers=4)
    assert got == [1.0, 0.0, 1.0, 0.0]
    assert all(pymath.isfinite(x) for x in got)
