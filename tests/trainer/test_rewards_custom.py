"""Custom rewards as README.md documents them: a file path or a module, sync and async functions,
batch functions, declared ranges and timeouts (issue 24)."""

import time

from trainer.rewards import build_reward, score_batch

REWARDS = '''
import asyncio
from helper import WANT                       # a neighbour of this file
from trainer.rewards import batch_reward, reward_range, reward_timeout

@reward_range(0, 2)
def sync_fn(text, example):
    return 5.0 if text == example["answer"] else 0.5      # clamped to [0, 2]

async def async_fn(text, example):
    await asyncio.sleep(0.01)
    return float(text == WANT)

@batch_reward
def batch_fn(texts, examples):
    batch_fn.calls += 1
    return [len(t) / 10 for t in texts]
batch_fn.calls = 0

@batch_reward
async def async_batch_fn(texts, examples):
    return [float(t == e["answer"]) for t, e in zip(texts, examples)]

@reward_timeout(0.2)
def slow_fn(text, example):
    import time
    time.sleep(1.0 if text == "slow" else 0)
    return 1.0

@reward_timeout(0.2)
async def slow_async_fn(text, example):
    await asyncio.sleep(5.0 if text == "slow" else 0)
    return 1.0

@batch_reward
def wrong_length(texts, examples):
    return [1.0]
'''


def test_rewards_from_a_file_path_sync_async_batch_and_timeouts(tmp_path, caplog):
    (tmp_path / "helper.py").write_text("WANT = 'yes'\n")
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    texts, examples = ["yes", "no", "slow"], [{"answer": "yes"}, {"answer": "yes"}, {"answer": "no"}]

    def scores(fn: str, **kw) -> list[float]:
        return score_batch(build_reward(f"{path}:{fn}", **kw), texts, examples)

    assert scores("sync_fn") == [2.0, 0.5, 0.5]
    assert scores("async_fn") == [1.0, 0.0, 0.0]
    reward = build_reward(f"{path}:batch_fn")
    assert score_batch(reward, texts, examples) == [0.3, 0.2, 0.4] and reward.fn.calls == 1  # one call
    assert reward("abcd", {}) == 0.4
    assert score_batch(build_reward(f"{path}:batch_fn", overlong_buffer=2, max_tokens=4), texts, examples,
                       num_tokens=[1, 3, 4]) == [0.3, 0.2 - 0.5, 0.4 - 1.0]
    assert scores("async_batch_fn") == [1.0, 0.0, 0.0]
    t0 = time.monotonic()
    assert scores("slow_fn") == [1.0, 1.0, 0.0] and scores("slow_async_fn") == [1.0, 1.0, 0.0]
    assert time.monotonic() - t0 < 2.0
    assert "TimeoutError" in caplog.text
    assert scores("wrong_length") == [0.0, 0.0, 0.0] and "returned 1 scores for 3" in caplog.text
