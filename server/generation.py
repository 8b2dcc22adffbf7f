"""Request handling shared by every generation route: prompts -> Sequences -> results.

    seqs = prepare(engine, config, prompts, options, max_tokens, n, field="prompt")
    seqs = await run_to_completion(engine, http_request, seqs)     # aborts if the client leaves
    async for kind, index, payload in stream_events(engine, submit(engine, seqs, stream=True)): ...
    sample = to_sample(seq, index, n)

Validation follows the API contract: empty prompt / invalid token ids / bad sampling
values -> 400 naming the field, prompt at or over `max_model_len` -> 413, prompt +
max_tokens over it -> 400 (`max_tokens`), full queue -> 429, engine stopped -> 503.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from dllm.sampling import SamplingParams
from dllm.tokenizer import encode
from rollout_client.protocol import DecodingOptions, Sample, TraceModel
from server.config import ServerConfig
from server.engine import Engine, EngineStopped, QueueFull
from server.errors import APIError


def to_sampling_params(opts: DecodingOptions, max_tokens: int, config: ServerConfig) -> SamplingParams:
    """SamplingParams of a request; fields the client left unset take the server defaults."""
    given = opts.model_fields_set

    def pick(name: str, default: Any) -> Any:
        return getattr(opts, name) if name in given else default

    return SamplingParams(
        max_tokens=max_tokens, temperature=pick("temperature", config.default_temperature),
        top_k=opts.top_k, top_p=opts.top_p, strategy=pick("strategy", config.default_strategy),
        steps=opts.steps, threshold=pick("threshold", config.default_threshold), seed=opts.seed,
        stop=opts.stop_list(), stop_token_ids=opts.stop_token_ids, ignore_eos=opts.ignore_eos)


def encode_prompts(engine: Engine, prompts: list[str | list[int]], field: str) -> list[list[int]]:
    out = []
    name = field
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise APIError(400, f"{name}: must not be empty", name)
            p = encode(engine.tokenizer, p)
        if not p:
            raise APIError(400, f"{name}: must contain at least one token", name)
        if len(p) >= engine.max_model_len:
            raise APIError(413, f"{name}: prompt has {len(p)} tokens; the limit is max_model_len="
                                f"{engine.max_model_len} (prompt + completion)", name)
        out.append(p)
    return out


def prepare(engine: Engine, config: ServerConfig, prompts: list[str | list[int]], opts: DecodingOptions,
            max_tokens: int | None, n: int, field: str = "prompt") -> list[Any]:
    """Tokenise and validate the prompts; build n Sequences per prompt (prompt-major)."""
    num_seqs = len(prompts) * n
    if num_seqs > engine.scheduler.max_queue:
        raise APIError(400, f"n: {len(prompts)} prompt(s) x n={n} = {num_seqs} sequences exceed what the server "
                            f"queues at once (max_queue={engine.scheduler.max_queue})", "n")
    if not prompts:
        raise APIError(400, f"{field}: must not be empty", field)
    seqs = []
    for ids in encode_prompts(engine, prompts, field):
        room = engine.max_model_len - len(ids)
        num = min(config.default_max_tokens, room) if max_tokens is None else max_tokens
        if num > room:
            raise APIError(400, f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({num}) exceeds "
                                f"max_model_len={engine.max_model_len}", "max_tokens")
        try:
            seqs += engine.make_sequences([ids], to_sampling_params(opts, num, config), n)
        except ValueError as e:
            err = APIError.from_value_error(e)
            if err.param == "prompt_ids" and field != "prompt_ids":
                err.param, err.message = field, f"{field}: " + err.message.split(": ", 1)[-1]
            raise err from None
    return seqs


def submit(engine: Engine, seqs: list[Any], stream: bool = False):
    try:
        return engine.submit(seqs, stream=stream)
    except QueueFull as e:
        raise APIError(429, str(e), None, {"Retry-After": "1"}) from None
    except EngineStopped as e:
        raise APIError(503, str(e)) from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_to_completion(engine: Engine, request: Request, seqs: list[Any]) -> list[Any]:
    """Run the sequences to the end; a client disconnect aborts them (slots freed)."""
    req = submit(engine, seqs)
    waiter = asyncio.ensure_future(engine.wait(req))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        if waiter.done():
            return waiter.result()
        raise APIError(499, "client disconnected")
    finally:
        for task in (waiter, gone):
            task.cancel()
        engine.abort(req)  # no-op when finished


async def stream_events(engine: Engine, req: Any):
    """Yield (kind, index, payload) events of a request submitted with `submit(..., stream=True)`;
    closing the generator early (client gone) aborts the request."""
    try:
        async for event in engine.events(req):
            if event[0] == "error":
                raise RuntimeError(event[2])
            yield event
    finally:
        engine.abort(req)


def trace_model(seq: Any) -> TraceModel:
    return TraceModel.model_validate({**seq.trace.to_dict(), "finish_reason": seq.finish_reason})


def to_sample(seq: Any, index: int, n: int, return_trace: bool = True) -> Sample:
    return Sample(index=index, prompt_index=index // n, prompt_ids=list(seq.prompt_ids),
                  completion_ids=list(seq.completion_ids), text=seq.text, finish_reason=seq.finish_reason,
                  version=seq.trace.version, num_forwards=seq.num_forwards,
                  trace=trace_model(seq) if return_trace else None)
