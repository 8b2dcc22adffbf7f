"""Incremental detokenisation with stop strings: each token is decoded once, stops are searched in new text only.

    text = TextStream(tokenizer, stop=["\\n\\n"])
    n = text.push(block_ids)    # None: no stop string yet (all ids consumed);
                                # else the fewest of these ids after which the text holds a stop string
    text.text                   # the completion text so far, cut before the first stop string

Decoding uses the `tokenizers` library's `DecodeStream` (special tokens skipped), which holds
back bytes of a character split across tokens, so `text` only ever grows by whole
characters and equals `tokenizer.decode(ids, skip_special_tokens=True)` of the ids pushed.
Without stop strings a block is decoded in one call; with them token by token, so the cut is
exact. A tokenizer without a fast backend falls back to decoding the whole completion after
each block (correct, quadratic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | None = None) -> None:
        self.tokenizer, self.stop = tokenizer, list(stop or [])
        self.text = ""
        self.ids: list[int] = []
        self._longest = max((len(s) for s in self.stop), default=0)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, ids: list[int]) -> int | None:
        """Append ids; returns None, or how many of them complete the first stop string (text cut there)."""
        if not ids:
            return None
        if self._backend is None:
            return self._push_full(ids)
        if not self.stop:
            self._append(self._stream.step(self._backend, list(ids)))
            return None
        for n, token_id in enumerate(ids, 1):
            if self._append(self._stream.step(self._backend, token_id)):
                return n
        return None

    def _append(self, chunk: str | None) -> bool:
        """Add decoded text; True (and the text cut) when it completes a stop string."""
        if not chunk:
            return False
        start = max(0, len(self.text) - self._longest + 1)
        self.text += chunk
        return self._cut(start)

    def _cut(self, start: int) -> bool:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def _push_full(self, ids: list[int]) -> int | None:
        """Slow path (no fast tokenizer): re-decode the whole completion."""
        def decode(upto: int) -> str:
            return self.tokenizer.decode(self.ids + ids[:upto], skip_special_tokens=True)

        start = max(0, len(self.text) - self._longest + 1)
        full = decode(len(ids))
        if not any(s in full[start:] for s in self.stop):
            self.text, self.ids = full, self.ids + list(ids)
            return None
        n = next(n for n in range(1, len(ids) + 1) if any(s in decode(n)[start:] for s in self.stop))
        self.text, self.ids = decode(n), self.ids + list(ids[:n])
        self._cut(start)
        return n
