"""Prompt data for RL: loading and a resumable, seeded, epoch-based prompt sampler.

`load_prompts(spec)` reads the records of a JSONL / JSON / Parquet / CSV file, a `datasets`
save_to_disk folder or a hub dataset id (`trainer.data.sources`; `split`, `limit`) and returns
examples `{**record, "prompt": <text to generate from>, "answer": <str>}` (rewards read
`example["answer"]`, code rewards `example["tests"]`). Field names are configurable; by default
the prompt comes from the first of `question`, `prompt`, `problem` and the answer from
`ground_truth_answer`, `answer` (so MATH500-style files load as is). A chat record (`messages`:
a list of {role, content}) is a prompt too: the turns up to the last user turn, and a final
assistant turn is the default answer. `prompt_template` formats the raw prompt
(`"{prompt}\\nPut the final answer in \\\\boxed{}."`); given a tokenizer with
`apply_chat_template`, the result is wrapped as a user turn (+ optional system) with the
generation prompt appended. The raw question stays in `example["question_text"]`.

`PromptSampler(examples, batch_size, seed)` yields batches forever: each epoch is a fresh
permutation drawn from (seed, epoch); a batch may straddle two epochs. `state_dict()` /
`load_state_dict()` save and restore the position for resume.

    examples = load_prompts("data/math500.jsonl", tokenizer=tok)
    sampler = PromptSampler(examples, batch_size=16, seed=0)
    batch = sampler.next_batch()
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from trainer.data.sources import read_records
from trainer.data.sources import source_problem as problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_PROMPT_FIELDS = ("question", "prompt", "problem")
DEFAULT_ANSWER_FIELDS = ("ground_truth_answer", "answer")
MESSAGES_FIELD = "messages"
log = logging.getLogger("dlrl.data")


def _pick(record: dict, field: str | None, defaults: Sequence[str], what: str, where: str) -> object:
    names = (field,) if field else tuple(defaults)
    for name in names:
        if name in record:
            return record[name]
    raise ValueError(f"{where}: missing {what} field {' / '.join(repr(n) for n in names)} "
                     f"(present: {', '.join(sorted(record)) or 'none'})")


def format_prompt(text: str, prompt_template: str = "{prompt}", tokenizer: PreTrainedTokenizerBase | None = None,
                  system_prompt: str | None = None) -> str:
    """The text the policy generates from; chat-templated when a tokenizer is given."""
    text = prompt_template.replace("{prompt}", text)  # not str.format: `\boxed{}` stays as written
    if tokenizer is None:
        return text
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _chat(messages: list[Any], where: str) -> tuple[list[dict], str | None]:
    """(prompt turns, answer of a final assistant turn or None) of a chat record."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(f"{where}: `{MESSAGES_FIELD}` must be a non-empty list of {{role, content}} turns")
    turns = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    answer = None
    if turns[-1]["role"] == "assistant":
        answer, turns = turns[-1]["content"], turns[:-1]
    if not turns or turns[-1]["role"] != "user":
        raise ValueError(f"{where}: `{MESSAGES_FIELD}` needs a user turn to answer")
    return turns, answer


def example_from_record(record: object, where: str, prompt_field: str | None = None, answer_field: str | None = None,
                        require_answer: bool = True, prompt_template: str = "{prompt}",
                        tokenizer: PreTrainedTokenizerBase | None = None, system_prompt: str | None = None) -> dict:
    """One parsed record -> an example; errors name `where` (file:line / row) and the field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    chat_answer = None
    if not prompt_field and MESSAGES_FIELD in record and not any(k in record for k in DEFAULT_PROMPT_FIELDS):
        prompt_field = MESSAGES_FIELD
    question = _pick(record, prompt_field, DEFAULT_PROMPT_FIELDS, "prompt", where)
    example = dict(record)
    if isinstance(question, list):  # chat turns
        turns, chat_answer = _chat(question, where)
        question = turns[-1]["content"]
        example["prompt"] = (tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
                             if tokenizer is not None else prompt_template.replace("{prompt}", question))
    else:
        example["prompt"] = format_prompt(str(question), prompt_template, tokenizer, system_prompt)
    defaults = DEFAULT_ANSWER_FIELDS
    if chat_answer is not None and not answer_field and not any(k in record for k in defaults):
        example["answer"] = chat_answer
    elif require_answer or answer_field:
        example["answer"] = str(_pick(record, answer_field, defaults, "answer", where))
    elif any(k in record for k in defaults):
        example["answer"] = str(_pick(record, None, defaults, "answer", where))
    example["question_text"] = str(question)
    return example


def load_prompts(path: str | Path, prompt_field: str | None = None, answer_field: str | None = None,
                 require_answer: bool = True, prompt_template: str = "{prompt}",
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 system_prompt: str | None = None, limit: int | None = None, split: str = "train") -> list[dict]:
    """Records of `path` (any source of trainer.data.sources; `split` for datasets / hub ids) ->
    examples, the first `limit`. Errors name the file, the line / row and the missing field."""
    examples: list[dict] = []
    for where, record in read_records(str(path), split):
        if limit and len(examples) >= limit:
            break
        examples.append(example_from_record(record, where, prompt_field, answer_field, require_answer,
                                            prompt_template, tokenizer, system_prompt))
    if not examples:
        raise ValueError(f"prompts: {str(path)!r} holds no examples")
    return examples


def report(key: str, spec: str, examples: list[dict], note: str = "") -> None:
    """Log how many examples `key` gave and the first one (prompt and answer), at start."""
    first = examples[0] if examples else {}
    log.info("%s: %d examples from %s%s; first: prompt=%r answer=%r", key, len(examples), spec or "the embedded task",
             f" ({note})" if note else "", str(first.get("prompt", ""))[:200], str(first.get("answer", ""))[:100])


def source_problem(spec: str) -> str:
    """"" when `spec` names readable prompt data (nothing is loaded), else what is wrong."""
    return problem(spec)


class Sampler(Protocol):
    """Where a run draws each step's prompts from: `PromptSampler`, or dlrl align's growing
    sources (trainer.align.data). Its state is checkpointed with the run."""

    def next_batch(self) -> list[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class PromptSampler:
    """Infinite seeded sampler over examples; epoch e uses permutation rng([seed, e])."""

    def __init__(self, examples: Sequence[dict], batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
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
        batch: list[dict] = []
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
