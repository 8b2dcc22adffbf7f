"""OpenAI-compatible completions and chat completions (JSON or SSE streams).

    resp = await completions(body, request)   # CompletionResponse | StreamingResponse
    resp = await chat(body, request)          # ChatCompletionResponse | StreamingResponse

Streams send one `data: {chunk}` event per committed block of each choice (the block's
new text), a last chunk per choice with its finish_reason, an optional usage chunk
(`stream_options={"include_usage": true}`), then `data: [DONE]`. dLLM options
(strategy, steps, threshold, top_k, seed, return_trace, ...) are extra request fields;
with `return_trace` each choice also carries its `trace`, `completion_ids` and `version`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from dllm.tokenizer import encode
from rollout_client import protocol as P
from server.errors import APIError, error_body
from server.generation import prepare, run_to_completion, stream_events, submit, trace_model

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def check_model(name: str | None, served: str) -> None:
    if name and name != served:
        raise APIError(404, f"model: {name!r} is not served here (serving {served!r})", "model")


def _usage(seqs: list[Any], n: int = 1) -> P.Usage:
    """OpenAI usage: each prompt counted once (not once per sample), every completion counted."""
    prompt = sum(len(s.prompt_ids) for s in seqs[::n])
    completion = sum(len(s.completion_ids) for s in seqs)
    return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _extras(seq: Any, body: P._OpenAIBase) -> dict:
    if not body.return_trace:
        return {}
    return {"trace": trace_model(seq), "completion_ids": list(seq.completion_ids), "version": seq.trace.version}


def _sse(obj: Any) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


async def completions(body: P.CompletionRequest, request: Request):
    st, t0 = request.app.state, time.perf_counter()
    check_model(body.model, st.engine.model_name)
    prompts = body.prompt_list()
    seqs = prepare(st.engine, st.config, prompts, body, body.max_tokens, body.n)
    prefixes = [p if isinstance(p, str) else st.engine.tokenizer.decode(p) for p in prompts] if body.echo else None
    if body.stream:
        return _stream(request, "/v1/completions", body, seqs, lambda rid, i, text, reason: P.CompletionResponse(
            id=rid, model=st.engine.model_name,
            choices=[P.CompletionChoice(index=i, text=text, finish_reason=reason)]), prefixes)
    seqs = await run_to_completion(st.engine, request, seqs)
    tok = st.engine.tokenizer
    choices = []
    for i, s in enumerate(seqs):
        logprobs = None
        if body.logprobs is not None:
            logprobs = P.ChoiceLogprobs(tokens=tok.convert_ids_to_tokens(s.completion_ids),
                                        token_logprobs=list(s.trace.logprobs))
        text = (prefixes[i // body.n] if prefixes else "") + s.text
        choices.append(P.CompletionChoice(index=i, text=text, finish_reason=s.finish_reason, logprobs=logprobs,
                                          **_extras(s, body)))
    st.metrics.observe_request("/v1/completions", 200, time.perf_counter() - t0, _usage(seqs, body.n).prompt_tokens)
    return P.CompletionResponse(id=P.new_id("cmpl"), model=st.engine.model_name, choices=choices,
                                usage=_usage(seqs, body.n), version=max(s.trace.version for s in seqs))


async def chat(body: P.ChatCompletionRequest, request: Request):
    st, t0 = request.app.state, time.perf_counter()
    check_model(body.model, st.engine.model_name)
    tok = st.engine.tokenizer
    messages = [m.model_dump() for m in body.messages]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt)
    except Exception as e:  # template errors are the caller's messages' fault
        raise APIError(400, f"messages: chat template failed: {e}", "messages") from None
    max_tokens = body.max_completion_tokens or body.max_tokens
    seqs = prepare(st.engine, st.config, [encode(tok, text)], body, max_tokens, body.n, field="messages")
    if body.stream:
        return _stream(request, "/v1/chat/completions", body, seqs, lambda rid, i, delta, reason: P.ChatCompletionChunk(
            id=rid, model=st.engine.model_name,
            choices=[P.ChatChunkChoice(index=i, delta=P.ChatDelta(content=delta), finish_reason=reason)]))
    seqs = await run_to_completion(st.engine, request, seqs)
    choices = []
    for i, s in enumerate(seqs):
        logprobs = None
        if body.logprobs:
            tokens = tok.convert_ids_to_tokens(s.completion_ids)
            logprobs = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                    for t, lp in zip(tokens, s.trace.logprobs)]}
        choices.append(P.ChatChoice(index=i, message=P.AssistantMessage(content=s.text), finish_reason=s.finish_reason,
                                    logprobs=logprobs, **_extras(s, body)))
    st.metrics.observe_request("/v1/chat/completions", 200, time.perf_counter() - t0, _usage(seqs, body.n).prompt_tokens)
    return P.ChatCompletionResponse(id=P.new_id("chatcmpl"), model=st.engine.model_name, choices=choices,
                                    usage=_usage(seqs, body.n), version=max(s.trace.version for s in seqs))


def _stream(request: Request, endpoint: str, body: P._OpenAIBase, seqs: list[Any],
            chunk: Callable[[str, int, str, str | None], Any], prefixes: list[str] | None = None):
    """SSE response: per-block text deltas, a finish chunk per choice, usage, [DONE]."""
    st = request.app.state
    rid = P.new_id("chatcmpl" if endpoint.endswith("chat/completions") else "cmpl")
    is_chat = endpoint.endswith("chat/completions")
    events = stream_events(st.engine, submit(st.engine, seqs, stream=True))  # 429 before any header

    async def body_iter() -> AsyncIterator[str]:
        t0, sent = time.perf_counter(), [""] * len(seqs)
        for i in range(len(seqs)):
            first = chunk(rid, i, prefixes[i // body.n] if prefixes else "", None)
            if is_chat:
                first.choices[0].delta.role = "assistant"
            yield _sse(first)
        try:
            async for kind, i, payload in events:
                text = (payload[1] if kind == "update" else seqs[i].text).rstrip("\ufffd")
                delta = text[len(sent[i]):] if text.startswith(sent[i]) else ""
                if delta or kind == "done":
                    sent[i] += delta
                    out = chunk(rid, i, delta, seqs[i].finish_reason if kind == "done" else None)
                    if kind == "done" and body.return_trace:
                        out.choices[0] = out.choices[0].model_copy(update=_extras(seqs[i], body))
                    yield _sse(out)
        except RuntimeError as e:
            yield _sse(error_body(500, str(e)))
        if body.include_usage():
            yield _sse(chunk(rid, 0, "", None).model_copy(update={"choices": [], "usage": _usage(seqs, body.n)}))
        yield "data: [DONE]\n\n"
        st.metrics.observe_request(endpoint, 200, time.perf_counter() - t0, _usage(seqs, body.n).prompt_tokens)

    async def guarded() -> AsyncIterator[str]:
        try:
            async for part in body_iter():
                yield part
        finally:
            await events.aclose()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)
