"""OpenAI-compatible completions and chat completions (JSON or SSE streams).

    resp = await completions(body, request)   # CompletionResponse | StreamingResponse
    resp = await chat(body, request)          # ChatCompletionResponse | StreamingResponse

Streams send one `data: {chunk}` event per committed block of each choice (the block's
new text), a last chunk per choice with its finish_reason (and its logprobs, when asked),
an optional usage chunk (`stream_options={"include_usage": true}`), then `data: [DONE]`; with
`stream_options={"continuous_usage_stats": true}` every chunk also carries its choice's usage so
far (its prompt's tokens, the completion tokens streamed; as vLLM). Chat `tools` / `tool_choice`
are refused (400 naming the field): no tool-call parser reads block-diffusion output.
Text that could still be the start of a stop string is held back until the next block
says whether it is one, so streamed text always equals the non-streamed text.
dLLM options (strategy, steps, threshold, top_k, seed, return_trace, ...) are extra
request fields; with `return_trace` each choice also carries its `trace`,
`completion_ids` and `version`. Logprobs: completions `logprobs=k` gives `tokens`,
`token_logprobs`, `top_logprobs` (k most likely + the sampled token) and `text_offset`;
chat `logprobs=true, top_logprobs=k` gives k alternatives per token (Backend.top_logprobs).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from rollout_client.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
)
from rollout_client.protocol.common import Usage, new_id
from rollout_client.protocol.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAIBase,
)
from server.api import likelihood
from server.api.errors import APIError, error_body
from server.api.generation import (
    check_logprobs,
    prepare,
    run_to_completion,
    stream_events,
    submit,
    trace_model,
)
from server.api.logprobs import chat_logprobs, completion_logprobs
from server.api.state import server_state
from server.engine.engine import EngineEvent
from server.engine.sequence import ServerSequence as Sequence
from server.recording.recording import record_ids, record_one

if TYPE_CHECKING:
    pass

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def check_model(name: str | None, served: str) -> None:
    if name and name != served:
        raise APIError(404, f"model: {name!r} is not served here (serving {served!r})", "model")


def _usage(seqs: list[Sequence], n: int = 1) -> Usage:
    """OpenAI usage: each prompt counted once (not once per sample), every completion counted."""
    prompt = sum(len(s.prompt_ids) for s in seqs[::n])
    completion = sum(len(s.completion_ids) for s in seqs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _extras(seq: Sequence, body: OpenAIBase) -> dict:
    if not body.return_trace:
        return {}
    return {"trace": trace_model(seq), "completion_ids": list(seq.completion_ids), "version": seq.trace.version}


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def hold_back(text: str, stops: list[str]) -> str:
    """`text` without its longest ending that is a proper prefix of a stop string."""
    keep = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                keep = min(keep, len(text) - size)
                break
    return text[:keep]


# --------------------------------------------------------------------------- endpoints

async def completions(body: CompletionRequest, request: Request) -> CompletionResponse | StreamingResponse:
    st, t0 = server_state(request.app), time.perf_counter()
    check_model(body.model, st.engine.model_name)
    check_logprobs(st.engine, body.logprobs is not None)
    if body.is_scoring():  # echo + logprobs: prompt log-likelihoods (server/api/likelihood.py)
        return await likelihood.completions(body, request)
    assert body.n is not None, "null means the default (_NullIsDefault)"
    prompts = body.prompt_list()
    seqs = await prepare(st, prompts, body, body.max_tokens, body.n)
    prefixes = None
    if body.echo:
        prefixes = await st.prompts.run(lambda: [p if isinstance(p, str) else st.prompts.tokenizer.decode(p)
                                                 for p in prompts])
    k = body.logprobs

    def logprobs(seq: Sequence) -> CompletionLogprobs | None:
        return None if k is None else completion_logprobs(st.prompts.tokenizer, seq, k)

    if body.stream:
        return await _stream(request, "/v1/completions", body, seqs, lambda rid, i, text, reason, lp=None: CompletionResponse(
            id=rid, model=st.engine.model_name,
            choices=[CompletionChoice(index=i, text=text, finish_reason=reason, logprobs=lp)]),
            prefixes, logprobs, k or 0, prompts)
    seqs = await run_to_completion(st.engine, request, seqs, num_top_logprobs=k or 0)
    all_logprobs = await st.prompts.run(lambda: [logprobs(s) for s in seqs])
    choices = []
    for i, (s, record_id) in enumerate(zip(seqs, await record_ids(st.recorder, seqs, prompts, body.n))):
        prefix = prefixes[i // body.n] if prefixes else ""
        choices.append(CompletionChoice(index=i, text=prefix + s.text, finish_reason=s.finish_reason,
                                          logprobs=all_logprobs[i], record_id=record_id, **_extras(s, body)))
    usage = _usage(seqs, body.n)
    st.metrics.observe_request("/v1/completions", 200, time.perf_counter() - t0, usage.prompt_tokens)
    return CompletionResponse(id=new_id("cmpl"), model=st.engine.model_name, choices=choices,
                                usage=usage, version=max(s.trace.version for s in seqs))


async def chat(body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse | StreamingResponse:
    st, t0 = server_state(request.app), time.perf_counter()
    check_model(body.model, st.engine.model_name)
    check_logprobs(st.engine, bool(body.logprobs))
    assert body.n is not None and body.add_generation_prompt is not None, "null means the default"
    for name in ("max_tokens", "max_completion_tokens"):  # the one not used must be in range too
        if (getattr(body, name) or 0) >= st.engine.max_model_len:
            raise APIError(413, f"{name}: {getattr(body, name)} is not below max_model_len={st.engine.max_model_len}",
                           name)
    ids = await st.prompts.encode_chat([m.for_template() for m in body.messages], body.add_generation_prompt)
    seqs = await prepare(st, [ids], body, body.max_completion_tokens or body.max_tokens, body.n, field="messages")
    k = (body.top_logprobs or 0) if body.logprobs else None

    def logprobs(seq: Sequence) -> ChatLogprobs | None:
        return None if k is None else chat_logprobs(st.prompts.tokenizer, seq, k)

    if body.stream:
        return await _stream(request, "/v1/chat/completions", body, seqs, lambda rid, i, delta, reason, lp=None:
                       ChatCompletionChunk(id=rid, model=st.engine.model_name, choices=[ChatChunkChoice(
                           index=i, delta=ChatDelta(content=delta), finish_reason=reason, logprobs=lp)]),
                       None, logprobs, k or 0)
    seqs = await run_to_completion(st.engine, request, seqs, num_top_logprobs=k or 0)
    all_logprobs = await st.prompts.run(lambda: [logprobs(s) for s in seqs])
    record_id_list = await record_ids(st.recorder, seqs, n=body.n)
    choices = [ChatChoice(index=i, message=ChatResponseMessage(content=s.text), finish_reason=s.finish_reason,
                            logprobs=all_logprobs[i], record_id=record_id, **_extras(s, body))
               for i, (s, record_id) in enumerate(zip(seqs, record_id_list))]
    usage = _usage(seqs, body.n)
    st.metrics.observe_request("/v1/chat/completions", 200, time.perf_counter() - t0, usage.prompt_tokens)
    return ChatCompletionResponse(id=new_id("chatcmpl"), model=st.engine.model_name, choices=choices,
                                    usage=usage, version=max(s.trace.version for s in seqs))


async def _stream(request: Request, endpoint: str, body: OpenAIBase, seqs: list[Sequence], chunk: Callable[..., Any],
            prefixes: list[str] | None, logprobs: Callable[[Sequence], BaseModel | None], num_top: int,
            prompts: list[str | list[int]] | None = None) -> StreamingResponse:
    """SSE response: per-block text deltas, a finish chunk per choice (with its record_id), usage, [DONE]."""
    st = server_state(request.app)
    is_chat = endpoint.endswith("chat/completions")
    rid = new_id("chatcmpl" if is_chat else "cmpl")
    stops = body.stop_list()
    events = stream_events(st.engine, await submit(st.engine, seqs, stream=True, num_top_logprobs=num_top))  # 429 now

    async def body_iter() -> AsyncIterator[str]:
        assert body.n is not None, "null means the default (_NullIsDefault)"
        t0, sent, num_sent = time.perf_counter(), [""] * len(seqs), [0] * len(seqs)

        # `chunk` builds a CompletionResponse or a ChatCompletionChunk (the endpoint's lambda): pydantic models
        # whose `choices` differ, so the stream writes to them untyped
        def with_usage(out: Any, i: int) -> Any:  # continuous_usage_stats: the choice's usage so far
            if body.continuous_usage():
                prompt = len(seqs[i].prompt_ids)
                out.usage = Usage(prompt_tokens=prompt, completion_tokens=num_sent[i],
                                  total_tokens=prompt + num_sent[i])
            return out

        for i in range(len(seqs)):
            first = chunk(rid, i, prefixes[i // body.n] if prefixes else "", None)
            if is_chat:
                first.choices[0].delta.role = "assistant"
            yield _sse(with_usage(first, i))
        try:
            async for kind, i, payload in events:
                done = kind == EngineEvent.DONE
                update = payload if isinstance(payload, tuple) else ([], "")  # UPDATE: (completion ids, text)
                text = seqs[i].text if done else hold_back(update[1].rstrip("\ufffd"), stops)
                delta = text[len(sent[i]):] if text.startswith(sent[i]) else ""
                if delta or done:
                    sent[i] += delta
                    num_sent[i] = len(seqs[i].completion_ids if done else update[0])
                    lp = await st.prompts.run(logprobs, seqs[i]) if done else None
                    out = chunk(rid, i, delta, seqs[i].finish_reason if done else None, lp)
                    if done and body.return_trace:
                        out.choices[0] = out.choices[0].model_copy(update=_extras(seqs[i], body))
                    if done:
                        out.choices[0].record_id = await record_one(st.recorder, seqs[i], prompts[i // body.n] if prompts else None)
                    yield _sse(with_usage(out, i))
        except APIError as e:  # past the request's deadline: its status, in the stream (the 200 went out)
            yield _sse(error_body(e.status, e.message))
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
