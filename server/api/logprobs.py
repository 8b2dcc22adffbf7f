"""OpenAI-shaped log-probabilities of a finished sequence (run on the tokenizer thread): each token's text, the
characters it adds to the decoded text, its log-probability and its top alternatives.

    completion_logprobs(tok, seq, k)   # /v1/completions: tokens, token_logprobs, top_logprobs, text_offset
    chat_logprobs(tok, seq, k)         # /v1/chat/completions: content[{token, logprob, bytes, top_logprobs}]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_client.protocol.chat import ChatLogprobs, TokenLogprob, TopLogprob
from rollout_client.protocol.openai import CompletionLogprobs
from server.engine.sequence import ServerSequence as Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_WINDOW = 8  # tokens of left context when measuring the text each token adds


def token_texts(tok: PreTrainedTokenizerBase, ids: list[int]) -> tuple[list[str], list[int]]:
    """Each token's own text (special tokens shown) and the characters it adds to the decoded text."""
    texts = tok.batch_decode([[i] for i in ids])
    added = []
    for j in range(len(ids)):
        lo = max(0, j - _WINDOW)
        before, after = tok.decode(ids[lo:j], skip_special_tokens=True), tok.decode(ids[lo:j + 1],
                                                                                     skip_special_tokens=True)
        added.append(max(0, len(after) - len(before)))
    return texts, added


def completion_logprobs(tok: PreTrainedTokenizerBase, seq: Sequence, k: int) -> CompletionLogprobs:
    """`text_offset` counts from the start of the completion (echo is never combined with logprobs)."""
    texts, added = token_texts(tok, seq.completion_ids)
    offsets, offset = [], 0
    for n in added:
        offsets.append(offset)
        offset += n
    top = seq.top_logprobs if k else None
    tops = []
    for j, (text, lp) in enumerate(zip(texts, seq.trace.logprobs)):
        alts = {tok.decode([i]): v for i, v in (top[j] if top else [])}
        alts.setdefault(text, lp)
        tops.append(alts)
    return CompletionLogprobs(tokens=texts, token_logprobs=list(seq.trace.logprobs), top_logprobs=tops,
                                text_offset=offsets)


def chat_logprobs(tok: PreTrainedTokenizerBase, seq: Sequence, k: int) -> ChatLogprobs:
    def entry(i: int, lp: float) -> dict:
        text = tok.decode([i])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    top = seq.top_logprobs if k else None
    return ChatLogprobs(content=[
        TokenLogprob(**entry(i, lp), top_logprobs=[TopLogprob(**entry(a, v)) for a, v in (top[j] if top else [])])
        for j, (i, lp) in enumerate(zip(seq.completion_ids, seq.trace.logprobs))])
