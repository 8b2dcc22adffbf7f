"""Math reward: the last `\\boxed{...}` of a completion against the reference answer.

    math(completion_text, {"answer": "\\frac{1}{2}"})   # 1.0 or 0.0; never raises

The answers are compared by `math_verify` (LaTeX extraction only: no sympy `parse_expr` eval of
model output), falling back to sympy `simplify(pred - gold) == 0` on a small safe alphabet. The
check runs in a `pebble` process pool (spawned workers, not forks of the trainer) with a
wall-clock limit per check: a pathological expression (`9^{9^{9^9}}`) costs one worker, which
pebble kills and replaces, and scores 0.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing
import os
import re
import threading

import pebble

logger = logging.getLogger("trainer.rewards")


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

    def to_sympy(s: str) -> sympy.Expr:  # parse_expr evals: only a small safe alphabet gets that far
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


def math_equal_local(pred: str, gold: str) -> bool:
    """The check itself, in this process (the pool runs it in a worker's main thread)."""
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


def _warm_worker() -> None:
    try:
        import math_verify  # noqa: F401  (import once per worker, not per check)
    except Exception:
        pass


_POOL_LOCK = threading.Lock()
_POOL: dict[str, pebble.ProcessPool] = {}


def _pool() -> pebble.ProcessPool:
    with _POOL_LOCK:
        pool = _POOL.get("pool")
        if pool is None or not pool.active:
            workers = max(1, min(8, os.cpu_count() or 1))
            pool = pebble.ProcessPool(max_workers=workers, initializer=_warm_worker,
                                      context=multiprocessing.get_context("spawn"))
            _POOL["pool"] = pool
        return pool


def close_pool() -> None:
    with _POOL_LOCK:
        pool = _POOL.pop("pool", None)
    if pool is not None:
        pool.stop()
        pool.join()


atexit.register(close_pool)


def math_equal(pred: str, gold: str, timeout: float = 5.0) -> bool:
    """math_equal_local in the pool; False on timeout or a dead worker."""
    future = _pool().schedule(math_equal_local, args=(pred, gold), timeout=timeout)
    try:
        return future.result() is True
    except concurrent.futures.TimeoutError:
        logger.warning("math reward: check timed out after %.1fs; reward 0", timeout)
    except Exception as e:  # a worker that died (memory, signal) scores 0 too
        logger.warning("math reward: check failed (%s: %s); reward 0", type(e).__name__, e)
    return False


def math(completion_text: str, example: dict, timeout: float = 5.0) -> float:
    pred = extract_boxed(completion_text)
    if pred is None:
        return 0.0
    gold = str(example["answer"])
    gold = extract_boxed(gold) or gold
    if _normalize(pred) == _normalize(gold):
        return 1.0
    return float(math_equal(pred, gold, timeout))
