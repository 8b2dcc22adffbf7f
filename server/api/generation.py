"""Request handling shared by every generation route: prompts -> Sequences -> results.

    st = server_state(request.app)                                  # server.api.state: st.prompts is a PromptEncoder
    seqs = await prepare(st, prompts, options, max_tokens, n, field="prompt")   # texts or ids
    seqs = await run_to_completion(engine, http_request, seqs)     # aborts if the client leaves
    async for kind, index, payload in stream_events(engine, await submit(engine, seqs, stream=True)): ...
    sample = to_sample(seq, index, n)

Validation follows the API contract: invalid token ids / bad sampling values -> 400 naming
the field; a request that does not fit the server -> 413 (prompt at or over
`max_model_len`, prompt + max_tokens over it, prompts x n over `max_queue`); full queue
-> 429; engine stopped -> 503. The decoder checks prompts and sampling values itself
(`dllm.errors.FieldError`, `TooLong` when it does not fit): they pass through here, named
after the request's prompt field, and become HTTP errors in `server.api.errors`. Tokenising
and chat templates run on one worker thread (server/api/prompts.py), never on the event loop, after a cheap
bound: a text longer than `max_model_len` x the longest token (in characters) cannot fit,
so it is a 413 without being tokenised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request

from dllm.errors import FieldError
from dllm.sampling_params import SamplingParams
from dllm.trace import Trace
from rollout_client.protocol.common import DecodingOptions
from rollout_client.protocol.native import Sample
from server.api.errors import APIError
from server.api.quotas import charge_tokens
from server.engine.engine import EngineEvent, EngineEventTuple, EngineStopped, QueueFull
from server.engine.scheduler import seq_tokens

if TYPE_CHECKING:
    from server.api.state import ServerState
    from server.config import ServerConfig
    from server.core.client import CoreClient as Engine
    from server.core.client import RemoteRequest as EngineRequest
    from server.engine.sequence import ServerSequence as Sequence


def to_sampling_params(opts: DecodingOptions, max_tokens: int, config: ServerConfig) -> SamplingParams:
    """SamplingParams of a request; fields the client left unset take the server defaults."""
    given = opts.model_fields_set
    assert opts.top_k is not None and opts.top_p is not None and opts.ignore_eos is not None, \
        "null means the default (_NullIsDefault)"

    def pick(name: str, default: T) -> T:
        return getattr(opts, name) if name in given else default

    return SamplingParams(
        max_tokens=max_tokens, temperature=pick("temperature", config.default_temperature),
        top_k=opts.top_k, top_p=opts.top_p, strategy=pick("strategy", config.default_strategy),
        steps=opts.steps, threshold=pick("threshold", config.default_threshold), seed=opts.seed,
        stop=opts.stop_list(), stop_token_ids=opts.stop_token_ids, ignore_eos=opts.ignore_eos,
        logit_bias=opts.logit_bias)


async def encode_prompts(state: ServerState, prompts: list[str | list[int]], field: str) -> list[list[int]]:
    """Token ids of each prompt (texts tokenised off the event loop; 413 for a text that cannot fit)."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await state.prompts.encode(texts, field) if texts else [])
    return [next(encoded) if isinstance(p, str) else p for p in prompts]


T = TypeVar("T")
PROMPT_FIELDS = ("prompt", "prompt_ids")  # what the decoder calls a prompt in its FieldErrors


async def prepare(state: ServerState, prompts: list[str | list[int]], opts: DecodingOptions, max_tokens: int | None,
                  n: int, field: str = "prompt") -> list[Sequence]:
    """Tokenise the prompts; build n Sequences per prompt (prompt-major), which checks them."""
    engine: Engine = state.engine
    num_seqs = len(prompts) * n
    if num_seqs > engine.scheduler.max_queue:
        raise APIError(413, f"n: {len(prompts)} prompt(s) x n={n} = {num_seqs} sequences exceed what the server "
                            f"queues at once (max_queue={engine.scheduler.max_queue})", "n")
    seqs = []
    for ids in await encode_prompts(state, prompts, field):
        room = engine.max_model_len - len(ids)  # none left: the decoder refuses the prompt (TooLong)
        num = min(state.config.default_max_tokens, room) if max_tokens is None else max_tokens
        try:
            seqs += engine.make_sequences([ids], to_sampling_params(opts, num, state.config), n)
        except FieldError as e:  # the decoder's names of the prompt -> the request's prompt field
            raise (e.renamed(field) if e.field in PROMPT_FIELDS and e.field != field else e) from None
    charge_tokens(sum(seq_tokens(s) for s in seqs))  # the API key's token rate (server/api/quotas.py)
    state.metrics.observe_params(n, [s.params.max_tokens for s in seqs[::n]])  # dlrl_request_params_*
    deadline, status = request_deadline(opts, state.config)
    for seq in seqs:
        seq.deadline, seq.deadline_status = deadline, status
    if state.recorder is not None:  # which samples are recorded: their commit starts as they finish
        state.recorder.expect(seqs, prompts, n)
    return seqs


def request_deadline(opts: DecodingOptions, config: ServerConfig) -> tuple[float | None, int]:
    """(time.monotonic() by which the request must finish, the status it gets past it): the
    client's `timeout` (408: the client's own choice), capped by `server.max_request_s`
    (503: the server's limit; 0 = none); (None, 0) = no deadline."""
    mine, cap = getattr(opts, "timeout", None), config.max_request_s
    if not mine and not cap:
        return None, 0
    if mine and (not cap or mine <= cap):
        return time.monotonic() + mine, 408
    return time.monotonic() + cap, 503


async def submit(engine: Engine, seqs: list[Sequence], stream: bool = False, num_top_logprobs: int = 0) -> EngineRequest:
    """Queue the sequences in the engine core (its answer awaited: a refusal is a 429 / 503 before any byte)."""
    try:
        return await engine.submit(seqs, stream=stream, num_top_logprobs=num_top_logprobs)
    except QueueFull as e:
        raise APIError(429, str(e), None, {"Retry-After": str(e.retry_after)}) from None
    except EngineStopped as e:
        raise APIError(503, str(e)) from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_to_completion(engine: Engine, request: Request, seqs: list[Sequence],
                            num_top_logprobs: int = 0) -> list[Sequence]:
    """Run the sequences to the end; a client disconnect aborts them (slots freed)."""
    req = await submit(engine, seqs, num_top_logprobs=num_top_logprobs)
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


async def stream_events(engine: Engine, req: EngineRequest) -> AsyncGenerator[EngineEventTuple, None]:
    """Yield (kind, index, payload) events of a request submitted with `submit(..., stream=True)`;
    closing the generator early (client gone) aborts the request. A request past its deadline
    raises APIError (408 its own `timeout`, 503 `server.max_request_s`), another failure RuntimeError."""
    try:
        async for event in engine.events(req):
            if event[0] == EngineEvent.ERROR and req.expired:
                raise APIError(req.deadline_status, req.expired)
            if event[0] == EngineEvent.ERROR:
                raise RuntimeError(event[2])
            yield event
    finally:
        engine.abort(req)


def trace_model(seq: Sequence) -> Trace:
    """The trace a response carries (a trace-free one: 0 steps and logprobs, `Trace.published`)."""
    return seq.trace.published(seq.finish_reason)


def check_logprobs(engine: Engine, asked: bool, field: str = "logprobs") -> None:
    """400 naming `field` when log-probabilities are asked of a runner that cannot give them (lmdeploy)."""
    if asked and not engine.info.has_top_logprobs:
        raise APIError(400, f"{field}: the {engine.backend.name} backend returns no log-probabilities aligned to "
                            "the generated tokens (serve with server.backend=native for logprobs)", field)


def to_sample(seq: Sequence, index: int, n: int, return_trace: bool = True) -> Sample:
    return Sample(index=index, prompt_index=index // n, prompt_ids=list(seq.prompt_ids),
                  completion_ids=list(seq.completion_ids), text=seq.text, finish_reason=seq.finish_reason,
                  version=seq.trace.version, num_forwards=seq.num_forwards,
                  trace=trace_model(seq) if return_trace else None)
