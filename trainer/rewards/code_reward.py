"""Code rewards: run a generated program against tests in sandboxes; the verdict is decided
where the program cannot reach it.

    passed, total = run_code_tests(program, "assert add(1, 2) == 3", timeout=10)
    reward = code(completion_text, {"tests": [...]})      # fraction of tests passed, in [0, 1]

`example["tests"]` is either
- assert-style: a string of statements (asserts are the tests, or, with no assert, expression
  statements like `check(add)`; other statements are setup) or a list of test snippets. The program
  runs in one sandbox, the tests in another: the tests call the program's functions through a pipe
  (values cross as plain data, other objects as handles), so the program can neither see the tests
  nor write the report the trainer reads, and an object whose `__eq__` always says True never
  reaches the comparison;
- stdin/stdout: a list of `{"input": str, "output": str}` (or `{"inputs": [...], "outputs": [...]}`);
  each case is one sandboxed run and its output is compared here, outside (trailing whitespace
  ignored).
A run past its deadline or its memory/CPU limits keeps the tests it passed before. Anything
malformed (no code block, bad tests, a garbled report) scores 0 without raising.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Sequence
from typing import cast

from trainer.rewards.sandbox import Sandbox, SandboxLimits

_MAX_REPORT_BYTES = 1 << 20


def extract_code(text: str) -> str | None:
    """The last ```python (or ```py) fenced block; else the last bare ``` block; else None."""
    blocks = re.findall(r"```(\w*)[^\n]*\n(.*?)```", text, flags=re.S)
    for want in (("python", "py", "python3"), ("",)):
        found = [code for lang, code in blocks if lang.lower() in want]
        if found:
            return found[-1]
    return None


def split_tests(tests: str | Sequence[str]) -> list[tuple[str, bool]]:
    """(source, is_test) steps. A string splits into its top-level statements: asserts are
    tests (or, with no assert, expression statements like `check(f)`), the rest is setup."""
    if not isinstance(tests, str):
        return [(str(t), True) for t in tests]
    try:
        body = ast.parse(tests).body
    except SyntaxError:
        return [(tests, True)]
    kind = ast.Assert if any(isinstance(n, ast.Assert) for n in body) else ast.Expr
    steps = [(ast.get_source_segment(tests, n) or "", isinstance(n, kind)) for n in body]
    return steps if any(t for _, t in steps) else [(tests, True)]


def io_cases(tests: object) -> list[tuple[str, str]] | None:
    """stdin/stdout cases as (input, expected output), or None when `tests` is assert-style."""
    if isinstance(tests, dict) and set(tests) >= {"inputs", "outputs"}:
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"], strict=True)]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, dict) for t in tests):
        return None
    if not all(isinstance(t.get("input"), str) and isinstance(t.get("output"), str) for t in tests):
        raise ValueError("tests: stdin/stdout cases need string 'input' and 'output'")
    return [(t["input"], t["output"]) for t in tests]


def _default_box(timeout: float, memory_mb: int) -> Sandbox:
    limits = SandboxLimits(wall_s=timeout, cpu_s=timeout, memory_mb=memory_mb)
    return Sandbox("bwrap", limits)


def run_code_tests(code: str, tests: object, timeout: float = 10.0, memory_mb: int = 1024,
                   sandbox: Sandbox | None = None) -> tuple[int, int]:
    """Run `code` against `tests` in sandboxes. Returns (num_passed, num_tests).
    `sandbox` (mode + limits) defaults to bwrap with `timeout` and `memory_mb` as limits."""
    box = sandbox or _default_box(timeout, memory_mb)
    cases = io_cases(tests)
    if cases is not None:
        return sum(_run_io_case(box, code, stdin, want) for stdin, want in cases), len(cases)
    steps = split_tests(cast("str | Sequence[str]", tests))  # not stdin/stdout cases: assert-style source
    num_tests = sum(is_test for _, is_test in steps)
    return len(_run_assert_tests(box, code, steps)), num_tests


def _run_assert_tests(box: Sandbox, code: str, steps: list[tuple[str, bool]]) -> set[int]:
    """The indices of the steps that are tests and passed (read from the tests sandbox's report)."""
    to_sol_r, to_sol_w = os.pipe()
    to_tst_r, to_tst_w = os.pipe()
    report = os.memfd_create("report", os.MFD_CLOEXEC)
    ends = [to_sol_r, to_sol_w, to_tst_r, to_tst_w]
    try:
        with box.run() as run:
            run.start({"role": "solution", "code": code, "rfd": to_sol_r, "wfd": to_tst_w},
                      pass_fds=(to_sol_r, to_tst_w))
            tests = run.start({"role": "tests", "steps": steps, "rfd": to_tst_r, "wfd": to_sol_w,
                               "out_fd": report}, pass_fds=(to_tst_r, to_sol_w, report))
            for fd in ends:
                os.close(fd)
            ends = []
            run.wait(tests)
        os.lseek(report, 0, os.SEEK_SET)
        return parse_report(os.read(report, _MAX_REPORT_BYTES), steps)
    finally:
        for fd in [*ends, report]:
            os.close(fd)


def parse_report(raw: bytes, steps: list[tuple[str, bool]]) -> set[int]:
    """Lines `"<index> 1"` name passed tests; anything else in the report is ignored."""
    passed = set()
    for line in raw.decode("ascii", errors="replace").splitlines():
        m = re.fullmatch(r"(\d{1,9}) ([01])", line)
        if m and int(m[1]) < len(steps) and steps[int(m[1])][1] and m[2] == "1":
            passed.add(int(m[1]))
    return passed


def _run_io_case(box: Sandbox, code: str, stdin: str, want: str) -> bool:
    fd_in, fd_out = os.memfd_create("stdin", os.MFD_CLOEXEC), os.memfd_create("stdout", os.MFD_CLOEXEC)
    try:
        os.write(fd_in, stdin.encode())
        os.lseek(fd_in, 0, os.SEEK_SET)
        with box.run() as run:
            proc = run.start({"role": "stdio", "code": code}, stdin=fd_in, stdout=fd_out)
            ok = run.wait(proc) == "exit" and proc.returncode == 0
        os.lseek(fd_out, 0, os.SEEK_SET)
        return ok and _same_output(os.read(fd_out, len(want.encode()) + _MAX_REPORT_BYTES), want)
    finally:
        os.close(fd_in)
        os.close(fd_out)


def _same_output(got: bytes, want: str) -> bool:
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip().splitlines()]

    return norm(got.decode(errors="replace")) == norm(want)


def code(completion_text: str, example: dict, timeout: float = 10.0, all_or_nothing: bool = False,
         sandbox: Sandbox | None = None) -> float:
    """Fraction of `example["tests"]` the last code block passes (`all_or_nothing`: 1.0 or 0.0)."""
    program = extract_code(completion_text)
    if program is None:
        return 0.0
    passed, total = run_code_tests(program, example["tests"], timeout=timeout, sandbox=sandbox)
    if total == 0:
        return 0.0
    return float(passed == total) if all_or_nothing else passed / total


def code_strict(completion_text: str, example: dict, sandbox: Sandbox | None = None) -> float:
    return code(completion_text, example, all_or_nothing=True, sandbox=sandbox)
