"""PromptEncoder: the handlers' tokenizer worker, one thread (HF tokenizers are not re-entrant).

    prompts = PromptEncoder(engine.tokenizer, engine.max_model_len)   # ServerState.prompts builds it
    ids = await prompts.encode(["text", ...], "prompt")      # 413 (TooLong) for a text that cannot fit
    ids = await prompts.encode_chat(messages, add_generation_prompt=True)
    out = await prompts.run(fn, *args)                       # anything else that needs the tokenizer

Errors are raised as data (`dllm.errors.FieldError`, `TooLong`); server.api.errors turns them into
the 400 / 413 responses naming the field. Imports nothing of the server's state (server/api/state.py
holds one of these).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from dllm.errors import FieldError, TooLong
from dllm.tokenizer import encode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # no types to mypy: it does not follow transformers

P = ParamSpec("P")
T = TypeVar("T")


class PromptEncoder:
    """The handlers' tokenizer, used on one worker thread only (HF tokenizers are not re-entrant)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        vocab = tokenizer.get_vocab()
        # a token covers at most this many characters of text (byte-level tokens: one char per byte)
        self.max_token_chars = max((len(t) for t in vocab), default=1)
        self.max_chars = max_model_len * self.max_token_chars
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlrl-tokenizer")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def check_chars(self, num_chars: int, field: str) -> None:
        if num_chars > self.max_chars:
            raise TooLong(field, f"{num_chars} characters cannot fit in max_model_len={self.max_model_len} "
                                 f"tokens (longest token: {self.max_token_chars} characters)")

    async def encode(self, texts: list[str], field: str) -> list[list[int]]:
        for text in texts:
            self.check_chars(len(text), field)
        return await self.run(lambda: [encode(self.tokenizer, t) for t in texts])

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        self.check_chars(sum(len(m.get("content") or "") for m in messages), "messages")

        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)
            except Exception as e:  # template errors are the caller's messages' fault
                raise FieldError("messages", f"chat template failed: {e}") from None
            self.check_chars(len(text), "messages")
            return encode(self.tokenizer, text)

        return await self.run(render)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["PromptEncoder"]
