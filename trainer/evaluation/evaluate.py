"""Evaluation with dlrl servers: pass@1 / pass@k, response length, tokens per forward and
wall time for each decoding setting. `dlrl eval` (trainer/eval_cli.py) and the trainer's
periodic evaluation both call `evaluate`.

    examples = load_eval_examples("data/math500.jsonl", tokenizer=tok)   # MATH500 / GSM8K style
    settings = make_settings(static_steps=[4], dynamic_thresholds=[0.9, 0.7])
    results = evaluate(["http://127.0.0.1:8000"], examples, build_reward("math"), settings,
                       num_samples=4, max_tokens=512, temperature=1.0, seed=0)
    print(format_table(results))
    write_results("runs/eval/results.json", results, config={...})

Records: the prompt from `question` / `prompt` / `problem`, the answer from
`ground_truth_answer` / `answer`, else the last `\\boxed{}` of `solution`; a GSM8K answer
("... #### 72") keeps what follows `####`. A sample is correct when its reward is >= 1.
pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) over n samples with c correct,
averaged over problems. Tokens per forward = committed tokens / denoising forwards, from
the traces (one forward per distinct (block, step)).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainer.data.prompts import load_prompts
from trainer.rewards import extract_boxed, score_batch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllm.trace import Trace
    from rollout_client.client import Prompt
    from rollout_client.protocol.rollout import Rollout
    from trainer.rewards.registry import Reward, RewardFn


class GenerateFn(Protocol):
    """`ServerFleet.generate`: `n` rollouts per prompt (text or token ids), prompt-major."""

    def __call__(self, prompts: Sequence[Prompt], n: int, **sampling: Any) -> list[Rollout]: ...


class EvalError(ValueError):
    """Bad evaluation input; the message names the key or the file and line."""


@dataclass(frozen=True)
class DecodingSetting:
    strategy: str = "dynamic"
    steps: int | None = None  # denoising steps per block (static / sequential)
    threshold: float | None = None  # confidence threshold (dynamic)
    block_size: int | None = None  # None = whatever the server decodes with

    @property
    def name(self) -> str:
        what = f"threshold={self.threshold}" if self.strategy == "dynamic" else f"steps={self.steps or 'B'}"
        return f"{self.strategy} {what}" + (f" block={self.block_size}" if self.block_size else "")

    def request_kwargs(self) -> dict:
        kw: dict = {"strategy": self.strategy}
        if self.steps is not None:
            kw["steps"] = self.steps
        if self.threshold is not None:
            kw["threshold"] = self.threshold
        return kw


def make_settings(static_steps: Sequence[int] = (), dynamic_thresholds: Sequence[float] = (),
                  block_sizes: Sequence[int] = ()) -> list[DecodingSetting]:
    """Every static steps value and dynamic threshold, for each block size ([] = the served one)."""
    base = [DecodingSetting("static", steps=int(s)) for s in static_steps]
    base += [DecodingSetting("dynamic", threshold=float(t)) for t in dynamic_thresholds]
    base = base or [DecodingSetting("dynamic", threshold=0.9)]
    sizes: list[int | None] = [*block_sizes] or [None]
    return [DecodingSetting(s.strategy, s.steps, s.threshold, b) for b in sizes for s in base]


@dataclass
class SettingResult:
    setting: DecodingSetting
    num_problems: int
    num_samples: int
    pass_at: dict[int, float]
    mean_reward: float
    mean_response_tokens: float
    tokens_per_forward: float
    wall_seconds: float
    block_size: int
    finish_reasons: dict[str, int]
    problems: list[dict] = field(default_factory=list)  # per problem: prompt, answer, completions

    def to_dict(self) -> dict:
        d = asdict(self)
        d["setting"] = {"name": self.setting.name, **asdict(self.setting)}
        d["pass_at"] = {str(k): v for k, v in self.pass_at.items()}
        return d


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def gold_answer(record: dict, where: str) -> str:
    for key in ("ground_truth_answer", "answer"):
        if key in record and record[key] is not None:
            text = str(record[key])
            return text.split("####")[-1].strip() if "####" in text else text
    if isinstance(record.get("solution"), str):
        boxed = extract_boxed(record["solution"])
        if boxed is not None:
            return boxed
        raise EvalError(f"{where}: `solution` has no \\boxed{{}} answer")
    raise EvalError(f"{where}: no answer field (ground_truth_answer / answer / solution with \\boxed{{}})")


def load_eval_examples(path: str | Path, prompt_field: str = "", answer_field: str = "",
                       tokenizer: PreTrainedTokenizerBase | None = None,
                       prompt_template: str = "{prompt}", system_prompt: str = "", limit: int = 0,
                       split: str = "train", require_answer: bool = True) -> list[dict]:
    """Records of any source (trainer.data.sources) -> examples with `prompt` (chat-templated when a
    tokenizer is given) and `answer` (GSM8K's `#### 72` tail, or MATH's \\boxed{} of `solution`)."""
    examples = load_prompts(path, prompt_field=prompt_field or None, answer_field=answer_field or None,
                            require_answer=False, prompt_template=prompt_template, tokenizer=tokenizer,
                            system_prompt=system_prompt or None, limit=limit or None, split=split)
    for i, ex in enumerate(examples):
        if not answer_field:
            try:
                ex["answer"] = gold_answer(ex, f"{path}: record {i + 1}")
            except EvalError:
                if require_answer:
                    raise
    return examples


def generate(generate_fn: GenerateFn, prompts: Sequence[Prompt], n: int, batch_size: int,
             **kw: Any) -> list[Rollout]:
    """All rollouts for `prompts` (n each, prompt-major), `batch_size` prompts at a time, through
    `generate_fn(prompts, n, **sampling)` (a `trainer.infra.fleet.ServerFleet.generate`)."""
    out: list[Rollout] = []
    for i in range(0, len(prompts), batch_size):
        out += generate_fn(prompts[i:i + batch_size], n, **kw)
    return out


def _trace_of(rollout: Rollout) -> Trace:
    if rollout.trace is None:  # ServerFleet.generate asks for traces
        raise EvalError("a server answered without the decoding trace (return_trace)")
    return rollout.trace


def run_setting(servers: list[str], examples: list[dict], reward_fn: RewardFn | Reward, setting: DecodingSetting,
                prompts: Sequence[Prompt], *, num_samples: int, sampling: dict[str, Any], batch_size: int,
                generate_fn: GenerateFn) -> SettingResult:
    t0 = time.perf_counter()
    rollouts = generate(generate_fn, prompts, num_samples, batch_size, **sampling, **setting.request_kwargs())
    wall = time.perf_counter() - t0
    traces = [_trace_of(r) for r in rollouts]
    sizes = {t.block_size for t in traces}
    if setting.block_size is not None and sizes != {setting.block_size}:
        raise EvalError(f"block_sizes: asked for block size {setting.block_size} but {', '.join(servers)} "
                        f"decode(s) with {sorted(sizes)}; let dlrl eval start its own server (no server at "
                        "eval.servers, eval.start_server=true) or start one with server.block_size")
    per_sample = [e for e in examples for _ in range(num_samples)]
    rewards = score_batch(reward_fn, [r.text for r in rollouts], per_sample)
    problems, counts = [], []
    for i, ex in enumerate(examples):
        group = list(zip(rollouts[i * num_samples:(i + 1) * num_samples], rewards[i * num_samples:]))
        comps: list[dict[str, Any]] = [{"text": r.text, "num_tokens": len(r.completion_ids), "finish_reason": r.finish_reason,
                  "reward": s, "correct": s >= 1.0, "version": r.version} for r, s in group]
        counts.append(sum(c["correct"] for c in comps))
        problems.append({"index": i, "prompt": ex["prompt"], "answer": ex.get("answer"), "completions": comps})
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, num_samples) if k <= num_samples})
    pass_at = {k: sum(pass_at_k(num_samples, c, k) for c in counts) / len(counts) for k in ks}
    tokens = sum(len(r.completion_ids) + len(t.tail_ids) for r, t in zip(rollouts, traces))
    reasons: dict[str, int] = {}
    for r in rollouts:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    return SettingResult(setting, len(examples), num_samples, pass_at, sum(rewards) / len(rewards),
                         sum(len(r.completion_ids) for r in rollouts) / len(rollouts),
                         tokens / max(1, sum(t.num_forwards for t in traces)), wall, sizes.pop(), reasons,
                         problems)


def evaluate(servers: list[str], examples: list[dict], reward_fn: RewardFn | Reward,
             settings: list[DecodingSetting], *, generate_fn: GenerateFn, num_samples: int = 1, max_tokens: int = 512, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop: list[str] | None = None,
             stop_token_ids: list[int] | None = None, prompts: Sequence[Prompt] | None = None,
             batch_size: int = 64) -> list[SettingResult]:
    """Generate `num_samples` completions per example with each decoding setting and score them.
    `generate_fn(prompts, n, **sampling) -> rollouts` generates on `servers` (the caller's
    `ServerFleet.generate`: one client); `prompts` (texts or token ids, one per example) default
    to `example["prompt"]`; settings with a block size must match what the servers decode with
    (EvalError otherwise)."""
    if not examples:
        raise EvalError("data: no examples to evaluate")
    if num_samples < 1:
        raise EvalError(f"num_samples: must be >= 1, got {num_samples}")
    prompts = prompts if prompts is not None else [e["prompt"] for e in examples]
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "seed": seed}
    if stop:
        sampling["stop"] = list(stop)
    if stop_token_ids:
        sampling["stop_token_ids"] = list(stop_token_ids)
    return [run_setting(servers, examples, reward_fn, s, prompts, num_samples=num_samples, sampling=sampling,
                        batch_size=batch_size, generate_fn=generate_fn) for s in settings]


def format_table(results: list[SettingResult]) -> str:
    """The console table: one row per decoding setting."""
    k = max((r.num_samples for r in results), default=1)
    head = ["setting", "block", "pass@1"] + ([f"pass@{k}"] if k > 1 else []) + \
           ["reward", "resp. tokens", "tok/forward", "wall s", "tok/s"]
    rows = []
    for r in results:
        tok_s = r.mean_response_tokens * r.num_problems * r.num_samples / max(r.wall_seconds, 1e-9)
        rows.append([r.setting.name, str(r.block_size), f"{100 * r.pass_at[1]:.1f}%"]
                    + ([f"{100 * r.pass_at.get(k, float('nan')):.1f}%"] if k > 1 else [])
                    + [f"{r.mean_reward:.3f}", f"{r.mean_response_tokens:.1f}", f"{r.tokens_per_forward:.2f}",
                       f"{r.wall_seconds:.1f}", f"{tok_s:.1f}"])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def write_results(path: str | Path, results: list[SettingResult], **meta: object) -> Path:
    """JSON file: `meta` (config, servers, ...) and every setting's metrics and generations."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "results": [r.to_dict() for r in results]}, indent=1) + "\n")
    return path
