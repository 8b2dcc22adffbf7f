"""Where `dlrl align` gets its data: growing prompt sources and the feedback records of live traffic.

    pool = PromptPool(StorePrompts(store, accept_reward=1.0), batch_size=32, seed=0)   # or TailedJSONL(path)
    examples = pool.next_batch()                 # waits (bounded) until the source holds prompts
    fb = FeedbackBuffer(store, block_size=4, max_len=512, capacity=4096)
    fb.poll()                                    # new labeled records -> checked Rollouts
    taken = fb.take(64, policy_version=17, max_staleness=12)   # newest first, stale ones dropped
    batch = MixedBatch(on_policy_batch, taken, group_size=8)

Prompt sources (`align.prompt_source`): `TailedJSONL` re-reads a JSONL that another process
appends to (complete lines only, bad lines skipped with a warning naming file:line);
`StorePrompts` takes the prompts users asked, with a completion a user accepted (reward >=
`align.accept_reward`) as the reference answer the reward function scores against (prompts
nobody accepted an answer for are not used). `PromptPool` serves batches from the growing
pool: prompts never used before first (oldest first), the rest drawn uniformly from the pool.

Feedback records are exact off-policy data: the server recorded the token ids, the decoding
trace and the behaviour log-probability of every token under the weights (`version`) that
generated the whole sample. A record becomes a `rollout_client.protocol.rollout.Rollout` carrying that
trace and version; the learner's importance correction (`train.is_correction`, see
`trainer.rl.correction`) recomputes the log-probs under the current weights and weights each
token by pi_current / mu_behaviour, so staleness is corrected exactly (and bounded by
`align.max_staleness`, except for records of the version serving now: the replicas trail the
trainer by a whole promotion, canary window included, and no fresher feedback exists). Greedy records (temperature 0) were produced by a deterministic
policy: their behaviour log-probs are set to 0 (mu = 1).

Advantages of feedback records. A record has no group (a user asked a prompt once), so the
GRPO group z-score has no same-prompt siblings. `MixedBatch` sorts the step's records by
version and cuts them into pseudo-groups of `group_size` records; the learner's group
z-score then gives A_i = (r_i - mean) / std over the pseudo-group: a batch baseline that
estimates the expected reward of the version that served them (REINFORCE with a baseline,
scaled like the on-policy groups), so an answer is pushed up when a user liked it more than
that version's typical answer. Pseudo-groups whose rewards are all equal carry no signal and
are dropped by DAPO filtering like any group.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dllm.ranges import TEMPERATURE
from dllm.trace import Trace
from rollout_client.protocol.rollout import Rollout
from trainer.data.prompts import example_from_record
from trainer.loop import StopRequested
from trainer.rl.rollouts import Batch

if TYPE_CHECKING:
    from store import FeedbackStore, Record

log = logging.getLogger("dlrl.align")
WAIT_LOG_S = 15.0  # a line about a wait for prompts at least this often


class NoData(RuntimeError):
    """The source held no prompts within `align.prompt_wait_s`."""


# ---------------------------------------------------------------------------------- prompt sources
class TailedJSONL:
    """A JSONL that grows: each `read()` returns the examples of the lines appended since."""

    def __init__(self, path: str | Path, **fields: Any) -> None:
        self.path, self.fields = Path(path), fields
        if not self.path.is_file():
            raise FileNotFoundError(f"align.prompt_source: no such file {str(self.path)!r}")
        self.offset, self.lineno, self.num_bad = 0, 0, 0

    @property
    def cursor(self) -> int:
        return self.offset

    def read(self, upto: int | None = None) -> list[dict]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read() if upto is None else f.read(max(0, upto - self.offset))
        end = data.rfind(b"\n") + 1  # a line still being written waits for its newline
        out = []
        for raw in data[:end].splitlines():
            self.lineno += 1
            if not raw.strip():
                continue
            where = f"{self.path}:{self.lineno}"
            try:
                out.append(example_from_record(json.loads(raw), where, **self.fields))
            except (ValueError, UnicodeDecodeError) as e:  # json errors are ValueErrors
                self.num_bad += 1
                log.warning("align.prompt_source: skipping %s: %s", where, e)
        self.offset += end
        return out


class StorePrompts:
    """Prompts users asked, each with a completion a user accepted as its reference answer."""

    def __init__(self, store: FeedbackStore, accept_reward: float = 1.0, page: int = 1000) -> None:
        self.store, self.accept_reward, self.page = store, accept_reward, page
        self.seq = 0
        self.seen: set[str] = set()

    @property
    def cursor(self) -> int:
        return self.seq

    def read(self, upto: int | None = None) -> list[dict]:
        out = []
        while True:
            rows = self.store.labeled(after_seq=self.seq, limit=self.page)
            rows = [r for r in rows if upto is None or r.seq <= upto]
            for lab in rows:
                self.seq = max(self.seq, lab.seq)
                rec = lab.record
                if lab.reward < self.accept_reward or not rec.prompt or rec.prompt in self.seen:
                    continue
                self.seen.add(rec.prompt)
                out.append({"prompt": rec.prompt, "answer": rec.text, "source_record": rec.id})
            if len(rows) < self.page:
                return out


class StaticPrompts:
    """A fixed list (train.data or the embedded task's training split): `prompt_source: task`."""

    def __init__(self, examples: list[dict]) -> None:
        self.examples, self.done = examples, False

    @property
    def cursor(self) -> int:
        return int(self.done)

    def read(self, upto: int | None = None) -> list[dict]:
        if self.done or upto == 0:
            return []
        self.done = True
        return list(self.examples)


PromptSource = StorePrompts | StaticPrompts | TailedJSONL  # where dlrl align's prompts come from (align.prompt_source)


class PromptPool:
    """The trainer's sampler over a growing source (`next_batch`, `state_dict`, `load_state_dict`,
    as `trainer.data.prompts.PromptSampler`); `batch_size` may change between batches."""

    def __init__(self, source: PromptSource, batch_size: int, seed: int = 0, wait_s: float = 600.0,
                 should_stop: Callable[[], bool] = lambda: False) -> None:
        self.source, self.batch_size, self.wait_s, self.should_stop = source, batch_size, wait_s, should_stop
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.pool: list[dict] = []
        self.fresh = 0  # pool[fresh:] were never used

    def refill(self) -> int:
        new = self.source.read()
        self.pool += new
        return len(new)

    def next_batch(self) -> list[dict]:
        if self.batch_size <= 0:
            return []
        t0 = time.monotonic()
        deadline, next_log = t0 + self.wait_s, t0 + WAIT_LOG_S
        self.refill()
        while not self.pool:
            if self.should_stop():
                raise StopRequested("stopped while waiting for prompts")
            if time.monotonic() > deadline:
                raise NoData(f"align.prompt_source: no prompts after {self.wait_s:.0f}s (align.prompt_wait_s)")
            if time.monotonic() >= next_log:
                next_log = time.monotonic() + WAIT_LOG_S
                log.info("waiting for the first prompts from align.prompt_source (%.0f s so far, at most %.0f s: "
                         "align.prompt_wait_s)", time.monotonic() - t0, self.wait_s)
            time.sleep(0.5)
            self.refill()
        take = min(self.batch_size, len(self.pool) - self.fresh)
        batch = self.pool[self.fresh:self.fresh + take]
        self.fresh += take
        if len(batch) < self.batch_size:
            idx = self.rng.integers(0, len(self.pool), self.batch_size - len(batch))
            batch += [self.pool[int(i)] for i in idx]
        return batch

    def state_dict(self) -> dict:
        return {"cursor": self.source.cursor, "num_pool": len(self.pool), "fresh": self.fresh, "seed": self.seed,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        """Re-read the source up to the saved cursor (the same pool), then the saved position."""
        self.pool = self.source.read(upto=int(state["cursor"]))
        if len(self.pool) != int(state["num_pool"]):
            raise ValueError(f"align.prompt_source: the source holds {len(self.pool)} prompts up to the saved "
                             f"cursor, the checkpoint saw {state['num_pool']} (was it rewritten?)")
        self.fresh = int(state["fresh"])
        self.rng.bit_generator.state = state["rng"]


# ---------------------------------------------------------------------------------- feedback records
@dataclass
class FeedbackSample:
    rollout: Rollout
    reward: float
    feedback_time: float
    record_id: str
    seq: int


def record_rollout(rec: Record, block_size: int, max_len: int) -> Rollout | str:
    """A stored record as a Rollout for replay, or the reason it cannot be one (hostile until checked)."""
    try:
        trace = Trace.model_validate(rec.trace)
    except ValueError as e:
        return f"bad trace: {str(e).splitlines()[0]}"
    n = len(rec.completion_ids)
    if not rec.prompt_ids or n == 0:
        return "empty prompt or completion"
    if rec.finish_reason not in ("stop", "length"):
        return f"finish_reason {rec.finish_reason!r}"
    if trace.block_size != block_size:
        return f"block size {trace.block_size} (the policy decodes with {block_size})"
    if trace.prompt_len != len(rec.prompt_ids) or len(trace.steps) != n or len(trace.logprobs) != n:
        return "trace does not match the token ids"
    if len(trace.tail_ids) != len(trace.tail_steps) or len(rec.prompt_ids) + n + len(trace.tail_ids) > max_len:
        return "bad tail or too long"
    if any(not 1 <= s <= block_size for s in trace.steps + trace.tail_steps):
        return "trace step outside the block"
    if any(not (math.isfinite(lp) and lp <= 1e-6) for lp in trace.logprobs):
        return "behaviour log-prob not finite or positive"
    if float((rec.sampling or {}).get("temperature", TEMPERATURE.default) or 0.0) == 0.0:
        trace = trace.model_copy(update={"logprobs": [0.0] * n})  # greedy: a deterministic behaviour policy
    return Rollout.copy_from(rec, prompt_index=0, sample_index=0, trace=trace, server=str(rec.server))


class FeedbackBuffer:
    """Labeled records read from the store in arrival order, checked, waiting to be trained on."""

    def __init__(self, store: FeedbackStore, block_size: int, max_len: int, capacity: int = 4096, page: int = 1000) -> None:
        self.store, self.block_size, self.max_len, self.page = store, block_size, max_len, page
        self.queue: deque[FeedbackSample] = deque()
        self.capacity = capacity
        self.seq = 0  # feedback cursor (Labeled.seq)
        self.counts = {"received": 0, "used": 0, "stale": 0, "invalid": 0, "overflow": 0}

    def poll(self, on_new: Callable[[FeedbackSample], None] | None = None) -> int:
        """Read the feedback that arrived since the last poll (each checked record also goes to
        `on_new`); returns the number of new labeled records."""
        new = 0
        while True:
            rows = self.store.labeled(after_seq=self.seq, limit=self.page)  # stale ones counted in take
            for lab in rows:
                self.seq = max(self.seq, lab.seq)
                new += 1
                roll = record_rollout(lab.record, self.block_size, self.max_len)
                if isinstance(roll, str):
                    self.counts["invalid"] += 1
                    log.warning("feedback record %s skipped: %s", lab.record.id, roll)
                    continue
                if not math.isfinite(lab.reward):
                    self.counts["invalid"] += 1
                    continue
                sample = FeedbackSample(roll, float(lab.reward), float(lab.feedback_time), lab.record.id, int(lab.seq))
                self.queue.append(sample)
                if on_new is not None:
                    on_new(sample)
            if len(rows) < self.page:
                break
        while len(self.queue) > self.capacity:
            self.queue.popleft()
            self.counts["overflow"] += 1
        self.counts["received"] += new
        return new

    def drop_stale(self, policy_version: int, max_staleness: int, serving_version: int | None = None) -> int:
        """Drop records more than `max_staleness` versions behind the policy, except those of
        `serving_version` or newer (what the replicas serve now, or its canary): no user can give
        fresher feedback, so they are kept however far the trainer has moved on."""
        floor = policy_version - max_staleness
        if serving_version is not None:
            floor = min(floor, serving_version)
        keep = deque(s for s in self.queue if s.rollout.version >= floor)
        dropped = len(self.queue) - len(keep)
        self.queue = keep
        self.counts["stale"] += dropped
        return dropped

    def take(self, n: int, policy_version: int, max_staleness: int,
             serving_version: int | None = None) -> list[FeedbackSample]:
        """Up to n records, newest first (the freshest data, the shortest way to serving), none
        staler than `max_staleness` versions unless of the serving version (`drop_stale`); older
        ones wait until they are stale or pushed out."""
        self.drop_stale(policy_version, max_staleness, serving_version)
        out = [self.queue.pop() for _ in range(min(n, len(self.queue)))]
        self.counts["used"] += len(out)
        return out

    def __len__(self) -> int:
        return len(self.queue)

    def state_dict(self) -> dict:
        """The feedback cursor: a resumed run reads what arrived after it (the records waiting at
        the stop are older than what is arriving and are not read again)."""
        return {"seq": self.seq, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.seq = int(state["seq"])
        self.counts.update(state.get("counts") or {})


# ---------------------------------------------------------------------------------- the mixed batch
class MixedBatch(Batch):
    """On-policy groups first, then feedback pseudo-groups of `group_size` records each."""

    def __init__(self, on_policy: Batch, feedback: list[FeedbackSample], group_size: int) -> None:
        groups = len(feedback) // group_size
        self.feedback = sorted(feedback, key=lambda s: s.rollout.version)[:groups * group_size]
        self.num_on_policy = len(on_policy.examples)
        pseudo = [{"prompt": "<feedback>", "feedback_group": g} for g in range(groups)]
        rollouts = list(on_policy.rollouts) + [s.rollout for s in self.feedback]
        super().__init__(list(on_policy.examples) + pseudo, rollouts, 0, len(rollouts), on_policy.seconds)

    def group_examples(self, group_size: int) -> list[dict]:
        on = [e for e in self.examples[:self.num_on_policy] for _ in range(group_size)]
        return on + [{"prompt": s.rollout.text, "feedback_reward": s.reward} for s in self.feedback]


class AlignReward:
    """The run's reward with feedback records scored by their users."""

    def __init__(self, base: Callable[..., float]) -> None:
        self.base = base
        self.name = getattr(base, "name", "") or getattr(base, "__name__", "reward")

    def __call__(self, text: str, example: dict, num_tokens: int | None = None) -> float:
        if "feedback_reward" in example:
            return float(example["feedback_reward"])
        return self.base(text, example) if num_tokens is None else self.base(text, example, num_tokens)
