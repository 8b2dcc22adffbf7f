"""The registry of reward functions: built-ins, user functions by path, the DAPO overlong
penalty, clamping to a declared range, and batch scoring.

    reward = build_reward("math", overlong_buffer=256, max_tokens=2048)
    rewards = score_batch(reward, texts, examples, num_tokens=lengths)

A reward function is `fn(completion_text, example) -> float`. Its declared range is its
`reward_range` attribute (`@reward_range(lo, hi)`); the built-ins declare [0, 1]; a user function
that declares none gets `DEFAULT_RANGE`. A `Reward` never raises: an exception or a non-finite
value scores 0.0 (with a warning), anything else is clamped to the range before the overlong
penalty is added. `build_reward` checks that a code reward's sandbox can start (see
`trainer.rewards.sandbox`) and fails with an error naming the unsafe option otherwise.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math as _math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from trainer.rewards.code_reward import code, code_strict
from trainer.rewards.math_reward import math
from trainer.rewards.sandbox import MODES, Sandbox, SandboxLimits, SandboxUnavailable

logger = logging.getLogger("trainer.rewards")
RewardFn = Callable[[str, dict], float]
DEFAULT_RANGE = (-1.0, 1.0)


def reward_range(lo: float, hi: float) -> Callable[[RewardFn], RewardFn]:
    """Declare the range a reward function's scores are clamped to."""
    if not lo <= hi:
        raise ValueError(f"reward_range: need lo <= hi, got ({lo}, {hi})")

    def mark(fn: RewardFn) -> RewardFn:
        fn.reward_range = (float(lo), float(hi))
        return fn

    return mark


@reward_range(0.0, 1.0)
def exact_match(completion_text: str, example: dict) -> float:
    return float(completion_text.strip() == str(example["answer"]).strip())


for _fn in (math, code, code_strict):
    reward_range(0.0, 1.0)(_fn)

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match, "math": math, "code": code, "code_strict": code_strict}
CODE_REWARDS = ("code", "code_strict")


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
        if mod_name.endswith(".py"):
            raise ValueError(f"reward: cannot load {mod_name!r} for {spec!r}: {e}") from e
        raise ValueError(f"reward: cannot import {mod_name!r} for {spec!r}: {e}. A module must be importable: "
                         f"add the folder holding it to PYTHONPATH (now {os.environ.get('PYTHONPATH') or 'unset'}), "
                         "install it, or name the file instead: train.reward=path/to/file.py:function") from e
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


def _declared_range(fn) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in getattr(fn, "reward_range", None))
    except (TypeError, ValueError):
        return DEFAULT_RANGE
    return (lo, hi) if lo <= hi else DEFAULT_RANGE


def safe_score(fn, name: str, *args) -> float:
    """fn(*args) as a finite float, clamped to fn's declared range; 0.0 (and a warning) for an
    exception or a non-finite value. Never raises."""
    try:
        r = float(fn(*args))
    except Exception as e:
        logger.warning("reward %s raised %s: %s; reward 0", name, type(e).__name__, e)
        return 0.0
    if not _math.isfinite(r):
        logger.warning("reward %s returned %r; reward 0", name, r)
        return 0.0
    lo, hi = _declared_range(fn)
    return min(max(r, lo), hi)


@dataclass
class Reward:
    """A base reward (clamped to its range) plus the optional overlong penalty (applied when
    num_tokens is given). Calling it never raises."""

    fn: RewardFn
    name: str = ""
    max_tokens: int | None = None
    overlong_buffer: int = 0
    overlong_factor: float = 1.0

    def __call__(self, completion_text: str, example: dict, num_tokens: int | None = None) -> float:
        r = safe_score(self.fn, self.name, completion_text, example)
        if num_tokens is not None and self.overlong_buffer > 0:
            r += overlong_penalty(num_tokens, self.max_tokens, self.overlong_buffer, self.overlong_factor)
        return r


def build_reward(name_or_path: str, overlong_buffer: int = 0, max_tokens: int | None = None,
                 overlong_factor: float = 1.0, sandbox: str = "bwrap",
                 sandbox_limits: SandboxLimits | None = None) -> Reward:
    """The reward named by `name_or_path`. `sandbox` (bwrap | unsafe_local) and `sandbox_limits`
    apply to the code rewards, whose sandbox must start here (else ValueError naming the option)."""
    if overlong_buffer < 0:
        raise ValueError(f"overlong_buffer: must be >= 0, got {overlong_buffer}")
    if overlong_buffer > 0 and (max_tokens is None or not 0 < overlong_buffer <= max_tokens):
        raise ValueError(f"overlong_buffer: needs max_tokens >= overlong_buffer ({overlong_buffer}), "
                         f"got max_tokens={max_tokens}")
    if sandbox not in MODES:
        raise ValueError(f"reward_sandbox: {sandbox!r} is not one of {', '.join(MODES)}")
    fn = load_reward_fn(name_or_path)
    if getattr(fn, "reward_range", None) is None:
        logger.info("reward %s declares no reward_range; scores are clamped to %s", name_or_path, DEFAULT_RANGE)
    if name_or_path in CODE_REWARDS:
        box = Sandbox(sandbox, sandbox_limits)
        try:
            box.check()
        except SandboxUnavailable as e:
            raise ValueError(f"reward: {name_or_path!r} cannot run: {e}") from e
        fn, base = functools.partial(fn, sandbox=box), fn
        fn.reward_range = base.reward_range
    return Reward(fn, name_or_path, max_tokens, overlong_buffer, overlong_factor)


def score_batch(fn: RewardFn | Reward, texts: Sequence[str], examples: Sequence[dict],
                num_workers: int = 8, num_tokens: Sequence[int] | None = None) -> list[float]:
    """Scores texts[i] against examples[i]; num_tokens (lengths) is passed on to a `Reward`.
    A raising or non-finite reward becomes 0.0 with a warning; order is preserved."""
    if len(texts) != len(examples) or (num_tokens is not None and len(num_tokens) != len(texts)):
        raise ValueError(f"score_batch: {len(texts)} texts, {len(examples)} examples, "
                         f"{None if num_tokens is None else len(num_tokens)} lengths")
    name = getattr(fn, "name", None) or getattr(fn, "__name__", repr(fn))

    def one(i: int) -> float:
        args = (texts[i], examples[i]) if num_tokens is None else (texts[i], examples[i], num_tokens[i])
        if isinstance(fn, Reward):
            return fn(*args)
        return safe_score(fn, f"{name} on sample {i}", *args)

    if num_workers <= 1 or len(texts) <= 1:
        return [one(i) for i in range(len(texts))]
    with ThreadPoolExecutor(max_workers=min(num_workers, len(texts))) as pool:
        return list(pool.map(one, range(len(texts))))
