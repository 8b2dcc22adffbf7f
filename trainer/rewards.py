"""Reward functions for online RL: `fn(completion_text, example) -> float`.

Built-ins (see `BUILTIN_REWARDS`):
- `exact_match`: 1.0 iff the stripped completion equals `str(example["answer"]).strip()`
  (the embedded arithmetic task).
- `math`: the last complete `\\boxed{...}` of the completion (nested braces handled) is
  compared with `example["answer"]` by `math_verify` (parse/verify), falling back to
  sympy `simplify(a - b) == 0`. The check runs in a persistent worker subprocess with a
  wall-clock limit, so a pathological expression cannot hang the trainer: timeout -> 0.
- `code`: the last ```python block is run with `example["tests"]` (a string of asserts, or
  a list of test snippets) in a fresh `python -I` subprocess, in a temp dir, with an empty
  environment, a wall-time limit and rlimits (memory, CPU, file size). Reward = fraction of
  tests passed (`code_strict`: 1.0 only if all pass).

User functions load by path: `load_reward_fn("pkg.mod:fn")`, `"pkg.mod.fn"` or
`"path/to/file.py:fn"`. `build_reward(name_or_path, overlong_buffer=..., max_tokens=...)`
adds the DAPO soft overlong penalty; `score_batch` scores many completions in a thread pool
(an exception in a reward -> 0.0 and a logged warning).

    reward = build_reward("math", overlong_buffer=256, max_tokens=2048)
    rewards = score_batch(reward, texts, examples, num_tokens=lengths)

Note: only the Python standard library is imported at module level; this file is also the
math worker's script (`python -I rewards.py --math-worker`).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import importlib
import importlib.util
import json
import logging
import math as _math
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

logger = logging.getLogger(__name__)
RewardFn = Callable[[str, dict], float]


def exact_match(completion_text: str, example: dict) -> float:
    return float(completion_text.strip() == str(example["answer"]).strip())


# ---------------------------------------------------------------- math
def extract_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` in text, or None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)", text)]
    for i in reversed(starts):
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] != "{":  # `\boxed 5` form
            m = re.match(r"[^\s$]+", text[i:])
            if m:
                return m.group(0)
            continue
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j]
    return None


def _normalize(s: str) -> str:
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\\ |\s|\$", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    return s.rstrip(".")


def _sympy_equal(pred: str, gold: str) -> bool:
    """Fallback: crude LaTeX -> sympy text, then simplify(pred - gold) == 0."""
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication_application as imp
    from sympy.parsing.sympy_parser import parse_expr, standard_transformations

    safe_globals = {n: getattr(sympy, n) for n in ("Symbol", "Integer", "Float", "Rational", "Function")}
    safe_funcs = {"sqrt": sympy.sqrt, "pi": sympy.pi, "exp": sympy.exp, "log": sympy.log, "ln": sympy.log,
             "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan}

    def to_sympy(s: str):  # parse_expr evals: only a small safe alphabet gets that far
        s = _normalize(s)
        for _ in range(20):  # innermost-first rewriting of \frac{a}{b} and \sqrt{a}
            s2 = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
            s2 = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s2)
            if s2 == s:
                break
            s = s2
        s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("^", "**")
        s = s.replace("{", "(").replace("}", ")")
        names = set(re.findall(r"[A-Za-z]+", s))
        if not re.fullmatch(r"[0-9A-Za-z+\-*/().]*", s) or any(len(n) > 1 and n not in safe_funcs for n in names):
            raise ValueError(f"refusing to parse {s!r}")
        return parse_expr(s, global_dict=dict(safe_funcs, **safe_globals),
                          transformations=standard_transformations + (imp,))

    try:
        return bool(sympy.simplify(to_sympy(pred) - to_sympy(gold)) == 0)
    except Exception:
        return False


def _math_equal_local(pred: str, gold: str) -> bool:
    """Runs inside the worker process (main thread: math_verify's signal timeouts work)."""
    if _normalize(pred) == _normalize(gold):
        return True
    try:
        from math_verify import LatexExtractionConfig, parse, verify

        latex_only = [LatexExtractionConfig()]  # no sympy parse_expr (eval) on model output
        gold_parsed = parse("\\boxed{" + gold + "}", latex_only)
        pred_parsed = parse("\\boxed{" + pred + "}", latex_only)
        if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed):
            return True
    except Exception:
        pass
    return _sympy_equal(pred, gold)


def _math_worker_main() -> None:
    try:
        import math_verify  # noqa: F401  (warm the import before saying ready)
    except Exception:
        pass
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps({"ok": _math_equal_local(req["pred"], req["gold"])}), flush=True)


class _MathWorker:
    """One persistent `python -I rewards.py --math-worker` speaking JSON lines."""

    def __init__(self, startup_timeout: float = 60.0):
        cmd = [sys.executable, "-I", os.path.abspath(__file__), "--math-worker"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self._buf = b""
        if self._readline(time.monotonic() + startup_timeout) != b"ready":
            self.close()
            raise RuntimeError("math reward worker failed to start")

    def _readline(self, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def ask(self, pred: str, gold: str, timeout: float) -> bool | None:
        """True/False, or None on timeout or a dead worker (the caller then closes it)."""
        try:
            self.proc.stdin.write((json.dumps({"pred": pred, "gold": gold}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return None
        line = self._readline(time.monotonic() + timeout)
        return None if line is None else bool(json.loads(line)["ok"])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class _MathPool:
    """Idle workers reused across calls; a worker that timed out is killed, not reused."""

    def __init__(self, max_idle: int = 16):
        self._idle: list[_MathWorker] = []
        self._lock = threading.Lock()
        self.max_idle = max_idle

    def check(self, pred: str, gold: str, timeout: float) -> bool:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or _MathWorker()
        ok = worker.ask(pred, gold, timeout)
        if ok is None:
            worker.close()
            logger.warning("math reward: check timed out after %.1fs; reward 0", timeout)
            return False
        with self._lock:
            keep = len(self._idle) < self.max_idle
            if keep:
                self._idle.append(worker)
        if not keep:
            worker.close()
        return ok

    def close_all(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


_MATH_POOL = _MathPool()
atexit.register(_MATH_POOL.close_all)


def math(completion_text: str, example: dict, timeout: float = 5.0) -> float:
    pred = extract_boxed(completion_text)
    if pred is None:
        return 0.0
    gold = str(example["answer"])
    gold = extract_boxed(gold) or gold
    if _normalize(pred) == _normalize(gold):
        return 1.0
    return float(_MATH_POOL.check(pred, gold, timeout))


# ---------------------------------------------------------------- code
_HARNESS = """
import json, os, resource, sys
def main():  # locals only: the solution does not see the nonce as a global of __main__
    nonce = sys.stdin.readline().strip()
    with open("job.json") as f:
        job = json.load(f)
    os.remove("job.json")
    for lim, val in ((resource.RLIMIT_AS, job["mem"]), (resource.RLIMIT_CPU, job["cpu"]),
                     (resource.RLIMIT_FSIZE, job["fsize"]), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(lim, (val, val))
        except (ValueError, OSError):
            pass
    out = sys.stdout
    sys.stdout = sys.stderr = open(os.devnull, "w")
    ns = {"__name__": "__solution__"}
    def run(src):
        try:
            exec(compile(src, "<solution>", "exec"), ns)
            return True
        except BaseException:
            return False
    ok = run(job["code"])
    passed = sum(int(run(src) and ok and is_test) for src, is_test in job["steps"])
    out.write(nonce + json.dumps({"passed": passed, "ok": ok}) + "\\n")
    out.flush()
main()
"""


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


def run_code_tests(code: str, tests: str | Sequence[str], timeout: float = 10.0,
                   memory_mb: int = 2048) -> tuple[int, int]:
    """Run code + tests in an isolated subprocess. Returns (num_passed, num_tests)."""
    steps = split_tests(tests)
    num_tests = sum(t for _, t in steps)
    nonce = os.urandom(8).hex()
    job = {"code": code, "steps": steps, "mem": memory_mb << 20, "cpu": int(timeout) + 1,
           "fsize": 16 << 20}
    with tempfile.TemporaryDirectory(prefix="dlrl_code_") as tmp:
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(job, f)
        with open(os.path.join(tmp, "harness.py"), "w") as f:
            f.write(_HARNESS)
        with open(os.path.join(tmp, "stdout"), "w+b") as out:
            proc = subprocess.Popen([sys.executable, "-I", "harness.py"], cwd=tmp, env={},
                                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                proc.communicate((nonce + "\n").encode(), timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return 0, num_tests
            finally:  # also reaps anything the solution forked into its process group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            out.seek(0)
            lines = [ln for ln in out.read().decode(errors="replace").splitlines() if ln.startswith(nonce)]
    if not lines:
        return 0, num_tests
    return int(json.loads(lines[-1][len(nonce):])["passed"]), num_tests


def code(completion_text: str, example: dict, timeout: float = 10.0, all_or_nothing: bool = False) -> float:
    program = extract_code(completion_text)
    if program is None:
        return 0.0
    passed, total = run_code_tests(program, example["tests"], timeout=timeout)
    if total == 0:
        return 0.0
    return float(passed == total) if all_or_nothing else passed / total


def code_strict(completion_text: str, example: dict) -> float:
    return code(completion_text, example, all_or_nothing=True)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match, "math": math, "code": code, "code_strict": code_strict}


# ---------------------------------------------------------------- loading, combining, batching
def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name, `pkg.mod:fn`, `pkg.mod.fn` or `path/file.py:fn`."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    mod_name, _, fn_name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not mod_name or not fn_name:
        raise ValueError(f"reward: {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
                         "nor 'module:function'")
    try:
        if mod_name.endswith(".py"):
            file_spec = importlib.util.spec_from_file_location(f"_dlrl_reward_{abs(hash(mod_name))}", mod_name)
            if file_spec is None or not os.path.isfile(mod_name):
                raise ImportError(f"no such file {mod_name!r}")
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward: cannot import {mod_name!r} for {spec!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward: {spec!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO soft overlong punishment: 0 up to max_len - buffer, then linear down to -factor
    at max_len, and -factor beyond."""
    if buffer <= 0 or length <= max_len - buffer:
        return 0.0
    if length > max_len:
        return -factor
    return factor * ((max_len - buffer) - length) / buffer


@dataclass
class Reward:
    """A base reward plus the optional overlong penalty (applied when num_tokens is given)."""

    fn: RewardFn
    name: str = ""
    max_tokens: int | None = None
    overlong_buffer: int = 0
    overlong_factor: float = 1.0

    def __call__(self, completion_text: str, example: dict, num_tokens: int | None = None) -> float:
        r = float(self.fn(completion_text, example))
        if num_tokens is not None and self.overlong_buffer > 0:
            r += overlong_penalty(num_tokens, self.max_tokens, self.overlong_buffer, self.overlong_factor)
        return r


def build_reward(name_or_path: str, overlong_buffer: int = 0, max_tokens: int | None = None,
                 overlong_factor: float = 1.0) -> Reward:
    if overlong_buffer < 0:
        raise ValueError(f"overlong_buffer: must be >= 0, got {overlong_buffer}")
    if overlong_buffer > 0 and (max_tokens is None or not 0 < overlong_buffer <= max_tokens):
        raise ValueError(f"overlong_buffer: needs max_tokens >= overlong_buffer ({overlong_buffer}), "
                         f"got max_tokens={max_tokens}")
    return Reward(load_reward_fn(name_or_path), name_or_path, max_tokens, overlong_buffer, overlong_factor)


def score_batch(fn: RewardFn | Reward, texts: Sequence[str], examples: Sequence[dict],
                num_workers: int = 8, num_tokens: Sequence[int] | None = None) -> list[float]:
    """Scores texts[i] against examples[i]; num_tokens (lengths) is passed on to a `Reward`.
    A raising or non-finite reward becomes 0.0 with a warning; order is preserved."""
    if len(texts) != len(examples) or (num_tokens is not None and len(num_tokens) != len(texts)):
        raise ValueError(f"score_batch: {len(texts)} texts, {len(examples)} examples, "
                         f"{None if num_tokens is None else len(num_tokens)} lengths")
    name = getattr(fn, "name", None) or getattr(fn, "__name__", repr(fn))

    def one(i: int) -> float:
        try:
            r = fn(texts[i], examples[i]) if num_tokens is None else fn(texts[i], examples[i], num_tokens[i])
            r = float(r)
        except Exception as e:
            logger.warning("reward %s raised %s: %s on sample %d; reward 0", name, type(e).__name__, e, i)
            return 0.0
        if not _math.isfinite(r):
            logger.warning("reward %s returned %r on sample %d; reward 0", name, r, i)
            return 0.0
        return r

    if num_workers <= 1 or len(texts) <= 1:
        return [one(i) for i in range(len(texts))]
    with ThreadPoolExecutor(max_workers=min(num_workers, len(texts))) as pool:
        return list(pool.map(one, range(len(texts))))


if __name__ == "__main__" and sys.argv[1:] == ["--math-worker"]:
    _math_worker_main()
