"""Tests for the code rewards (trainer.rewards.code_reward): tests against generated programs in
bubblewrap sandboxes, assert-style (the tests in their own sandbox) and stdin/stdout (output
compared outside). Escape attempts live in test_rewards_sandbox.py."""

import math as pymath
import textwrap
import time

import pytest

from trainer import rewards as R
from trainer.rewards.code_reward import parse_report


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
    tests = ["assert 'HOME' not in ENV and 'PATH' not in ENV", "assert CWD == '/tmp'",
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


def test_score_batch_code_rewards():
    texts = [ADD, _py("def add(a, b):\n    return a - b\n")] * 2
    got = R.score_batch(R.build_reward("code"), texts, [{"tests": ["assert add(1, 2) == 3"]}] * 4, num_workers=4)
    assert got == [1.0, 0.0, 1.0, 0.0]
    assert all(pymath.isfinite(x) for x in got)


def test_tests_reach_the_program_through_values_and_handles():
    program = _py("""
        class Solution:
            def two_sum(self, nums, target):
                seen = {}
                for i, x in enumerate(nums):
                    if target - x in seen:
                        return [seen[target - x], i]
                    seen[x] = i
        class Node:
            def __init__(self, val, nxt=None):
                self.val, self.next = val, nxt
        def reverse(head):
            prev = None
            while head:
                head.next, prev, head = prev, head, head.next
            return prev
        def count(n):
            yield from range(n)
        def checked(x, *, scale=1):
            if x < 0:
                raise ValueError("negative")
            return x * scale
        def odd_values():
            return {1: (2.5, float("nan"), b"x", {3}, frozenset([4]), 1j, None)}
    """)
    tests = textwrap.dedent("""
        import math
        def to_list(head):
            out = []
            while head is not None:
                out.append(head.val)
                head = head.next
            return out
        assert Solution().two_sum([2, 7, 11], 9) == [0, 1]
        assert to_list(reverse(Node(1, Node(2, Node(3))))) == [3, 2, 1]
        assert list(count(3)) == [0, 1, 2] and len(list(count(0))) == 0
        assert checked(2, scale=3) == 6
        def raises_value_error():
            try:
                checked(-1)
            except ValueError as e:
                return "negative" in str(e)
            return False
        assert raises_value_error()
        v = odd_values()[1]
        assert v[0] == 2.5 and math.isnan(v[1]) and v[2:5] == (b"x", {3}, frozenset([4])) and v[5] == 1j
    """)
    assert R.run_code_tests(R.extract_code(program), tests) == (6, 6)


def test_always_equal_objects_do_not_pass():
    hack = _py("""
        class Anything:
            def __eq__(self, other):
                return True
            __ne__ = lambda self, other: False
            __bool__ = lambda self: True
        def add(a, b):
            return Anything()
    """)
    assert R.code(hack, {"tests": ["assert add(1, 2) == 3", "assert 3 == add(1, 2)", "assert not add(1, 2) != 3"]}) == 0.0


def test_stdio_tests_compare_output_outside():
    program = _py("""
        a, b = map(int, input().split())
        print(a + b)
    """)
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2", "output": "5"}, {"input": "5 5", "output": " 10  \n\n"}]
    assert R.code(program, {"tests": cases}) == pytest.approx(2 / 3)
    apps_style = {"inputs": ["1 2", "3 4"], "outputs": ["3", "7"]}
    assert R.code(program, {"tests": apps_style}) == 1.0
    crash = _py("print(3)\nraise SystemExit(1)\n")
    assert R.code(crash, {"tests": [{"input": "", "output": "3"}]}) == 0.0  # right output, failed run


def test_timeout_keeps_the_tests_passed_before_it():
    program = _py("""
        def add(a, b):
            while a < 0:
                pass
            return a + b
    """)
    start = time.monotonic()
    tests = ["assert add(1, 2) == 3", "assert add(-1, 2) == 1", "assert add(2, 2) == 4"]
    assert R.run_code_tests(R.extract_code(program), tests, timeout=1.0) == (1, 3)
    assert time.monotonic() - start < 5.0


def test_parse_report_ignores_anything_malformed():
    steps = [("x = 1", False), ("assert x", True), ("assert x", True)]
    raw = b"1 1\n0 1\n2 7\n99 1\n-1 1\n2 1 extra\n\xff\xfe\n{}\n1 1\n"
    assert parse_report(raw, steps) == {1}  # 0 is setup, 99 out of range, the rest garbled
    assert parse_report(b"", steps) == set()
