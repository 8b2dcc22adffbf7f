"""Rewards for online RL: `fn(completion_text, example) -> float`, scored in batches.

    from trainer.rewards import build_reward, score_batch
    reward = build_reward("code", overlong_buffer=256, max_tokens=2048)   # or "math", "pkg.mod:fn"
    rewards = score_batch(reward, texts, examples, num_tokens=lengths)

Modules: `registry` (built-ins, `pkg.mod:fn` loading, declared ranges and clamping, the DAPO
overlong penalty, batch scoring), `math_reward` (`\\boxed{}` answers checked by math-verify in a
pebble process pool with timeouts), `code_reward` (tests run against generated programs),
`sandbox` (bubblewrap sandboxes and their limits), `watchdog` (memory and CPU limits of whole
process trees) and `harness` (the script run inside the sandboxes).
"""

from trainer.rewards.code_reward import code, code_strict, extract_code, run_code_tests, split_tests
from trainer.rewards.math_reward import extract_boxed, math
from trainer.rewards.registry import (
    BUILTIN_REWARDS,
    DEFAULT_RANGE,
    Reward,
    batch_reward,
    build_reward,
    exact_match,
    load_reward_fn,
    overlong_penalty,
    reward_range,
    reward_timeout,
    score_batch,
)
from trainer.rewards.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

__all__ = ["BUILTIN_REWARDS", "DEFAULT_RANGE", "Reward", "Sandbox", "SandboxLimits", "SandboxUnavailable",
           "batch_reward", "build_reward", "code", "code_strict", "exact_match", "extract_boxed", "extract_code", "load_reward_fn",
           "math", "overlong_penalty", "reward_range", "reward_timeout", "run_code_tests", "score_batch", "split_tests"]
