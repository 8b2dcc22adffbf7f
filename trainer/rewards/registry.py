"""The registry of reward functions: built-ins, user functions by path, the DAPO overlong
penalty, clamping to a declared range, and batch scoring.

    reward = build_reward("math", overlong_buffer=256, max_tokens=2048)
    rewards = score_batch(reward, texts, examples, num_tokens=lengths)

A reward function is `fn(completion_text, example) -> float`, or `async def` the same; a batch
function (`@batch_reward`) is `fn(texts, examples) -> list[float]` (sync or async), called once per
batch. Its declared range is its `reward_range` attribute (`@reward_range(lo, hi)`); the
built-ins declare [0, 1]; a user function that declares none gets `DEFAULT_RANGE`.
`@reward_timeout(seconds)` bounds one call (an async function is cancelled; a sync one is
abandoned in its thread). A `Reward` never raises: an exception, a timeout or a non-finite value
scores 0.0 (with a warning), anything else is clamped to the range before the overlong penalty is
added. The contract for users is in README.md ("Custom rewards"). `build_reward` checks that a code reward's sandbox can start (see
`trainer.rewards.sandbox`) and fails with an error naming the unsafe option otherwise.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import logging
import math as _math
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, SupportsFloat, TypeVar

from trainer.rewards.code_reward import code, code_strict
from trainer.rewards.math_reward import math
from trainer.rewards.sandbox import MODES, Sandbox, SandboxLimits, SandboxUnavailable

logger = logging.getLogger("trainer.rewards")
RewardFn = Callable[[str, dict], float]
DEFAULT_RANGE = (-1.0, 1.0)
UserFn = Callable[..., Any]  # a user's reward function: sync or async, per text or batched; its value is checked
F = TypeVar("F", bound=UserFn)


def _set_marker(fn: Callable, name: str, value: object) -> None:
    """The markers (reward_range, reward_timeout, batched) are attributes of the function or partial,
    which mypy has no type for."""
    setattr(fn, name, value)


def reward_range(lo: float, hi: float) -> Callable[[RewardFn], RewardFn]:
    """Declare the range a reward function's scores are clamped to."""
    if not lo <= hi:
        raise ValueError(f"reward_range: need lo <= hi, got ({lo}, {hi})")

    def mark(fn: RewardFn) -> RewardFn:
        _set_marker(fn, "reward_range", (float(lo), float(hi)))
        return fn

    return mark


def batch_reward(fn: F) -> F:
    """Mark `fn(texts, examples) -> list[float]` as scoring a whole batch in one call."""
    _set_marker(fn, "batched", True)
    return fn


def reward_timeout(seconds: float) -> Callable[[RewardFn], RewardFn]:
    """Bound one call of the reward function (a call past it scores 0.0 with a warning)."""
    if not seconds > 0:
        raise ValueError(f"reward_timeout: need seconds > 0, got {seconds}")

    def mark(fn: RewardFn) -> RewardFn:
        _set_marker(fn, "reward_timeout", float(seconds))
        return fn

    return mark


def _is_async(fn: UserFn) -> bool:
    return inspect.iscoroutinefunction(fn)  # also sees through functools.partial


def invoke(fn: UserFn, *args: object) -> Any:
    """fn(*args), awaiting an async function, within fn's `reward_timeout` (TimeoutError past it)."""
    timeout = getattr(fn, "reward_timeout", None)
    if _is_async(fn):
        async def run() -> Any:
            return await asyncio.wait_for(fn(*args), timeout)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(run())
        with ThreadPoolExecutor(1) as pool:  # called from inside an event loop: a loop of its own
            return pool.submit(asyncio.run, run()).result()
    if timeout is None:
        return fn(*args)
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout)
    finally:
        pool.shutdown(wait=False)  # a sync call past its timeout is abandoned, not killed


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
            if file_spec is None or file_spec.loader is None or not os.path.isfile(mod_name):
                raise ImportError(f"no such file {mod_name!r}")
            module = importlib.util.module_from_spec(file_spec)
            folder = os.path.dirname(os.path.abspath(mod_name))
            sys.path.insert(0, folder)  # the file may import its neighbours
            try:
                file_spec.loader.exec_module(module)
            finally:
                sys.path.remove(folder)
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


def _declared_range(fn: UserFn) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in getattr(fn, "reward_range", ()))
    except (TypeError, ValueError):
        return DEFAULT_RANGE
    return (lo, hi) if lo <= hi else DEFAULT_RANGE


def safe_score(fn: UserFn, name: str, *args: object) -> float:
    """fn(*args) as a finite float, clamped to fn's declared range; 0.0 (and a warning) for an
    exception, a timeout or a non-finite value. Never raises."""
    try:
        r = float(invoke(fn, *args))
    except Exception as e:
        logger.warning("reward %s raised %s: %s; reward 0", name, type(e).__name__, e)
        return 0.0
    return _clamped(fn, name, r)


def _clamped(fn: UserFn, name: str, r: SupportsFloat | str) -> float:
    try:
        r = float(r)
    except (TypeError, ValueError):
        logger.warning("reward %s returned %r, not a number; reward 0", name, r)
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
        if getattr(self.fn, "batched", False):
            return self.score_many([completion_text], [example], None if num_tokens is None else [num_tokens])[0]
        r = safe_score(self.fn, self.name, completion_text, example)
        return r + self._penalty(num_tokens)

    def _penalty(self, num_tokens: int | None) -> float:
        if num_tokens is None or self.overlong_buffer <= 0:
            return 0.0
        assert self.max_tokens is not None, "overlong_buffer > 0 needs max_tokens (build_reward checks it)"
        return overlong_penalty(num_tokens, self.max_tokens, self.overlong_buffer, self.overlong_factor)

    def score_many(self, texts: Sequence[str], examples: Sequence[dict],
                   num_tokens: Sequence[int] | None = None) -> list[float]:
        """A batch function's scores for the batch (one call); all 0.0 if it raises, times out or
        returns the wrong number of scores."""
        try:
            raw = list(invoke(self.fn, list(texts), list(examples)))
            if len(raw) != len(texts):
                raise ValueError(f"returned {len(raw)} scores for {len(texts)} completions")
        except Exception as e:
            logger.warning("batch reward %s raised %s: %s; rewards 0", self.name, type(e).__name__, e)
            raw = [0.0] * len(texts)
        lengths = list(num_tokens) if num_tokens is not None else [None] * len(texts)
        return [_clamped(self.fn, f"{self.name} on sample {i}", r) + self._penalty(n)
                for i, (r, n) in enumerate(zip(raw, lengths))]


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
        base: Callable[..., float] = fn  # a code reward takes the sandbox as a keyword
        fn = reward_range(*_declared_range(base))(functools.partial(base, sandbox=box))
    return Reward(fn, name_or_path, max_tokens, overlong_buffer, overlong_factor)


def score_batch(fn: RewardFn | Reward, texts: Sequence[str], examples: Sequence[dict],
                num_workers: int = 8, num_tokens: Sequence[int] | None = None) -> list[float]:
    """Scores texts[i] against examples[i]; num_tokens (lengths) is passed on to a `Reward`.
    A raising or non-finite reward becomes 0.0 with a warning; order is preserved."""
    if len(texts) != len(examples) or (num_tokens is not None and len(num_tokens) != len(texts)):
        raise ValueError(f"score_batch: {len(texts)} texts, {len(examples)} examples, "
                         f"{None if num_tokens is None else len(num_tokens)} lengths")
    name = getattr(fn, "name", None) or getattr(fn, "__name__", repr(fn))
    if isinstance(fn, Reward) and getattr(fn.fn, "batched", False):
        return fn.score_many(texts, examples, num_tokens)

    def one(i: int) -> float:
        args = (texts[i], examples[i]) if num_tokens is None else (texts[i], examples[i], num_tokens[i])
        if isinstance(fn, Reward):
            return fn(*args)
        return safe_score(fn, f"{name} on sample {i}", *args)

    if num_workers <= 1 or len(texts) <= 1:
        return [one(i) for i in range(len(texts))]
    with ThreadPoolExecutor(max_workers=min(num_workers, len(texts))) as pool:
        return list(pool.map(one, range(len(texts))))
