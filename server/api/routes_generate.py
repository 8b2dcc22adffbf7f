"""Routes of the generation API: native `POST /generate` and the OpenAI-compatible `/v1/*`.

    curl -s localhost:8000/generate -d '{"prompt": "12+7=", "n": 2, "max_tokens": 8, "seed": 0}'
    curl -s localhost:8000/v1/completions -d '{"prompt": "12+7=", "max_tokens": 8, "stream": true}'

Handlers stay thin: validation, batching and response building live in
`server.api.generation` and `server.api.openai_api`; schemas in `rollout_client.protocol`.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from rollout_client.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from rollout_client.protocol.common import new_id
from rollout_client.protocol.native import GenerateRequest, GenerateResponse
from rollout_client.protocol.openai import CompletionRequest, CompletionResponse, ModelCard, ModelList
from server.api import likelihood, openai_api
from server.api.generation import check_logprobs, prepare, run_to_completion, to_sample
from server.api.openapi import error_responses
from server.api.state import server_state
from server.recording.recording import record_ids

router = APIRouter(tags=["generation"])
ERRORS = error_responses(400, 404, 408, 413, 429, 503)
SSE_EVENT = {"type": "object", "required": ["data"], "description": "one server-sent event: `data` is a JSON "
             "chunk, or `[DONE]` last", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def _json_or_sse(model: type) -> dict:
    """200 of an OpenAI route: the JSON body, or an SSE stream of chunks with `stream: true`."""
    return {200: {"model": model, "description": "JSON, or with `stream: true` a text/event-stream of "
                  "`data: {chunk}` events ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


@router.post("/generate", response_model=GenerateResponse, responses=ERRORS)
async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
    st, t0 = server_state(request.app), time.perf_counter()
    openai_api.check_model(body.model, st.engine.model_name)
    assert body.n is not None and body.return_trace is not None, "null means the default (_NullIsDefault)"
    if body.max_tokens == 0:  # prompt log-likelihoods (server/api/likelihood.py)
        check_logprobs(st.engine, True, "max_tokens")
        return await likelihood.generate(body, request)
    field = "prompt" if body.prompt is not None else "prompt_ids"
    max_tokens = body.max_tokens if "max_tokens" in body.model_fields_set else None
    seqs = await prepare(st, body.prompt_list(), body, max_tokens, body.n, field)
    seqs = await run_to_completion(st.engine, request, seqs)
    samples = [to_sample(s, i, body.n, body.return_trace) for i, s in enumerate(seqs)]
    for sample, record_id in zip(samples, await record_ids(st.recorder, seqs, body.prompt_list(), body.n)):
        sample.record_id = record_id
    usage = openai_api._usage(seqs, body.n)
    st.metrics.observe_request("/generate", 200, time.perf_counter() - t0, usage.prompt_tokens)
    return GenerateResponse(id=new_id("gen"), model=st.engine.model_name,
                              version=max(s.version for s in samples), samples=samples, usage=usage)


@router.post("/v1/completions", response_model=None, responses={**_json_or_sse(CompletionResponse), **ERRORS})
async def completions(body: CompletionRequest, request: Request) -> CompletionResponse | StreamingResponse:
    return await openai_api.completions(body, request)


@router.post("/v1/chat/completions", response_model=None,
             responses={**_json_or_sse(ChatCompletionResponse), **ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse | StreamingResponse:
    return await openai_api.chat(body, request)


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    st = server_state(request.app)
    engine = st.engine
    info = engine.info  # the runner's declaration: its family and (full attention) cache mode
    version, pushed_by = engine.version, None
    if version and st.weight_updates is not None:  # who pushed the served version (its recorded outcome)
        pushed_by = (await st.weight_updates.state(version)).run_id or None
    return ModelList(data=[ModelCard(id=engine.model_name, max_model_len=engine.max_model_len, version=version,
                                     weights_run_id=pushed_by, family=info.family, cache_mode=info.cache_mode)])
