"""Prompt data for RL: JSONL loading and a resumable, seeded, epoch-based prompt sampler.

`load_prompts(path)` reads one JSON object per line and returns examples
`{**record, "prompt": <text to generate from>, "answer": <str>}` (rewards read
`example["answer"]`, code rewards `example["tests"]`). Field names are configurable; by default
the prompt comes from the first of `question`, `prompt`, `problem` and the answer from
`ground_truth_answer`, `answer` (so MATH500-style files load as is). `prompt_template`
formats the raw prompt (`"{prompt}\\nPut the final answer in \\\\boxed{{}}."`); given a
tokenizer with `apply_chat_template`, the result is wrapped as a user turn (+ optional system)
with the generation prompt appended. The raw question stays in `example["question_text"]`.

`PromptSampler(examples, batch_size, seed)` yields batches forever: each epoch is a fresh
permutation drawn from (seed, epoch); a batch may straddle two epochs. `state_dict()` /
`load_state_dict()` save and restore the position for resume.

    examples = load_prompts("data/math500.jsonl", tokenizer=tok)
    sampler = PromptSampler(examples, batch_size=16, seed=0)
    batch = sampler.next_batch()
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

DEFAULT_PROMPT_FIELDS = ("question", "prompt", "problem")
DEFAULT_ANSWER_FIELDS = ("ground_truth_answer", "answer")


def _pick(record: dict, field: str | None, defaults: Sequence[str], what: str, where: str):
    names = (field,) if field else tuple(defaults)
    for name in names:
        if name in record:
            return record[name]
    raise ValueError(f"{where}: missing {what} field {' / '.join(repr(n) for n in names)} "
                     f"(present: {', '.join(sorted(record)) or 'none'})")


def format_prompt(text: str, prompt_template: str = "{prompt}", tokenizer=None,
                  system_prompt: str | None = None) -> str:
    """The text the policy generates from; chat-templated when a tokenizer is given."""
    text = prompt_template.format(prompt=text)
    if tokenizer is None:
        return text
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def example_from_record(record, where: str, prompt_field: str | None = None, answer_field: str | None = None,
                        require_answer: bool = True, prompt_template: str = "{prompt}", tokenizer=None,
                        system_prompt: str | None = None) -> dict:
    """One parsed JSONL record -> an example; errors name `where` (file:line) and the field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    question = _pick(record, prompt_field, DEFAULT_PROMPT_FIELDS, "prompt", where)
    example = dict(record)
    if require_answer or answer_field:
        example["answer"] = str(_pick(record, answer_field, DEFAULT_ANSWER_FIELDS, "answer", where))
    elif any(k in record for k in DEFAULT_ANSWER_FIELDS):
        example["answer"] = str(_pick(record, None, DEFAULT_ANSWER_FIELDS, "answer", where))
    example["question_text"] = str(question)
    example["prompt"] = format_prompt(str(question), prompt_template, tokenizer, system_prompt)
    return example


def load_prompts(path: str | Path, prompt_field: str | None = None, answer_field: str | None = None,
                 require_answer: bool = True, prompt_template: str = "{prompt}", tokenizer=None,
                 system_prompt: str | None = None, limit: int | None = None) -> list[dict]:
    """JSONL -> examples. Errors name the file, the line number and the missing field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts: no such file {str(path)!r}")
    examples: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: bad JSON: {e.msg} (column {e.colno})") from e
            examples.append(example_from_record(record, where, prompt_field, answer_field, require_answer,
                                                prompt_template, tokenizer, system_prompt))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise ValueError(f"prompts: {str(path)!r} holds no examples")
    return examples


def source_problem(spec: str) -> str:
    """"" when `spec` names readable prompt data, else what is wrong (no loading)."""
    path = Path(spec)
    if path.is_file():
        return ""
    if path.exists():
        return f"{spec!r} is not a file"
    return f"no such file {spec!r}"


class PromptSampler:
    """Infinite seeded sampler over examples; epoch e uses permutation rng([seed, e])."""

    def __init__(self, examples: Sequence[dict], batch_size: int, seed: int = 0, shuffle: bool = True):
        if not examples:
            raise ValueError("PromptSampler: no examples")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.examples, self.batch_size, self.seed, self.shuffle = examples, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0  # next example is order(epoch)[index]
        self._order = self._make_order(0)

    def _make_order(self, epoch: int) -> np.ndarray:
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self) -> list[dict]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._make_order(self.epoch)
            batch.append(self.examples[int(self._order[self.index])])
            self.index += 1
        return batch

    def __iter__(self) -> Iterator[list[dict]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "num_examples": len(self.examples), "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.seed), ("num_examples", len(self.examples)), ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                raise ValueError(f"PromptSampler.load_state_dict: {key} is {state.get(key)!r} in the "
                                 f"saved state but {mine!r} here")
        if not 0 <= state["index"] <= len(self.examples) or state["epoch"] < 0:
            raise ValueError(f"PromptSampler.load_state_dict: bad position {state['epoch']}/{state['index']}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._make_order(self.epoch)
