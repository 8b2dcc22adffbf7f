"""Prompt log-likelihoods behind the generation API (dllm.likelihood run by the engine core, between steps).

    POST /generate        {"prompt": "12+7=19", "max_tokens": 0, "prompt_logprobs": 0}
    POST /v1/completions  {"prompt": "12+7=19", "echo": true, "logprobs": 1, "max_tokens": 0}

`likelihood` (per request, else `server.likelihood`): `sequential` (exact under the sequential
decoding policy) or `elbo` (`server.elbo_samples` seeded Monte Carlo samples of the masked-diffusion
ELBO; the request's `seed`, else 0). A full-attention model (LLaDA, Dream) is always scored by LLaDA's
ELBO, for every context / continuation split (dllm.full.likelihood; `sequential` is a 400). An ELBO
reports per token the standard error of the sum from that token on (`prompt_logprobs_stderr`,
OpenAI `logprobs.suffix_stderr`) and its number of samples. Each prompt runs in the engine core as one
`Engine.call_between_steps` (server.core: `Score`; so decoding of other requests interleaves, and the
weights do not change during it); the response
carries the version that scored it. Completions with echo + logprobs and max_tokens > 0 (as
lm-eval-harness's local-completions sends: max_tokens 1, reading all but the last entry; unset:
server.default_max_tokens) also generate, and the completion's logprobs follow the prompt's.

Refusals, before any model work: a prompt with no token or a token id out of the vocabulary / the
mask token (400 naming the field), over max_model_len or more prompts than server.max_queue (413),
the API key's token rate (server.api.quotas), more scoring calls waiting than server.max_queue (429).
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from fastapi import Request

from dllm.scores import Method, TokenScores
from rollout_client.protocol.common import DecodingOptions, Usage, new_id
from rollout_client.protocol.native import GenerateRequest, GenerateResponse, Sample
from rollout_client.protocol.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from server.api.errors import APIError
from server.api.generation import encode_prompts, prepare, run_to_completion, to_sampling_params
from server.api.logprobs import completion_logprobs, token_texts
from server.api.quotas import charge_tokens
from server.api.state import server_state

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # no types to mypy: it does not follow transformers

    from server.api.state import ServerState
    from server.core.client import CoreClient as Engine

_pending: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()  # scoring calls not yet done


def check_ids(ids: list[int], field: str, vocab: int, mask_id: int, max_len: int) -> None:
    if not ids:
        raise APIError(400, f"{field}: a prompt to score must contain at least one token", field)
    if len(ids) >= max_len:
        raise APIError(413, f"{field}: {len(ids)} tokens; the limit is below max_model_len={max_len}", field)
    bad = next((t for t in ids if not 0 <= t < vocab or t == mask_id), None)
    if bad is not None:
        raise APIError(400, f"{field}: invalid token id {bad} (vocab {vocab}, mask id {mask_id})", field)


async def score(st: ServerState, prompts: list[str | list[int]], field: str, opts: DecodingOptions,
                method: Method | None, top_k: int) -> tuple[list[list[int]], list[TokenScores], int]:
    """(token ids, scores, version) of each prompt; the checks of the module docstring first (and the
    decoding options' own, as a generation request gets them)."""
    engine = st.engine
    if not engine.info.has_likelihoods:  # the runner's declaration (dllm.likelihood scores block-causal models)
        raise APIError(400, f"{field}: prompt log-likelihoods (max_tokens 0, echo) are not available from this "
                            f"server's {engine.backend.name} runner: {engine.info.note}", field)
    full = engine.info.family != "sdar"  # LLaDA / Dream: LLaDA's ELBO (dllm.full.likelihood)
    if full and method == "sequential":
        raise APIError(400, "likelihood: 'sequential' is the likelihood of a block-causal decoding policy; this "
                            "server's model is full-attention (LLaDA / Dream), scored by the Monte Carlo ELBO "
                            "('elbo', the default here)", "likelihood")
    to_sampling_params(opts, 1, st.config).validate(engine.backend.block_size)
    if len(prompts) > engine.scheduler.max_queue:
        raise APIError(413, f"{field}: {len(prompts)} prompts exceed what the server queues at once "
                            f"(max_queue={engine.scheduler.max_queue})", field)
    ids_list = await encode_prompts(st, prompts, field)
    cfg = engine.model.config
    for ids in ids_list:
        check_ids(ids, field, cfg.vocab_size, cfg.mask_token_id, engine.max_model_len)
    charge_tokens(sum(len(ids) for ids in ids_list))
    if _pending.get(engine, 0) + len(ids_list) > engine.scheduler.max_queue:
        raise APIError(429, "too many prompt log-likelihoods waiting; retry later", None, {"Retry-After": "1"})
    how: Method = "elbo" if full else (method or st.config.likelihood)
    _pending[engine] = _pending.get(engine, 0) + len(ids_list)
    try:
        results, version = await engine.score(ids_list, how, top_k, st.config.elbo_samples, opts.seed or 0)
    finally:
        _pending[engine] -= len(ids_list)
    return ids_list, [TokenScores(lp, top, rows, err, n) for lp, top, rows, err, n in results], version


def likelihood_of(st: ServerState, asked: Method | None) -> Method:
    """The method that scores a request: the ELBO for a full-attention model, else the request's or the server's."""
    if st.engine.info.family != "sdar":  # the runner's declaration
        return "elbo"
    return asked or st.config.likelihood


async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
    """POST /generate with max_tokens 0: one Sample per prompt with its prompt_logprobs."""
    st, t0 = server_state(request.app), time.perf_counter()
    field = "prompt" if body.prompt is not None else "prompt_ids"
    assert body.prompt_logprobs is not None, "checked by GenerateRequest"
    ids_list, scores, version = await score(st, body.prompt_list(), field, body, body.likelihood,
                                            body.prompt_logprobs)
    how = likelihood_of(st, body.likelihood)
    samples = [Sample(index=i, prompt_index=i, prompt_ids=ids, completion_ids=[], text="", finish_reason="length",
                      version=version, num_forwards=s.num_rows, prompt_logprobs=s.logprobs,
                      prompt_top_logprobs=s.top if body.prompt_logprobs else None, likelihood=how,
                      prompt_logprobs_stderr=s.stderr, likelihood_samples=s.num_samples)
               for i, (ids, s) in enumerate(zip(ids_list, scores))]
    num = sum(len(ids) for ids in ids_list)
    st.metrics.observe_request("/generate", 200, time.perf_counter() - t0, num)
    return GenerateResponse(id=new_id("gen"), model=st.engine.model_name, version=version, samples=samples,
                            usage=Usage(prompt_tokens=num, completion_tokens=0, total_tokens=num))


def _prompt_logprobs(tok: PreTrainedTokenizerBase, ids: list[int], s: TokenScores, k: int) -> tuple[str, CompletionLogprobs]:
    """(the prompt's text, its OpenAI logprobs): first token null; top_logprobs = k most likely + the token."""
    texts, added = token_texts(tok, ids)
    offsets, offset = [], 0
    for n in added:
        offsets.append(offset)
        offset += n
    tops: list[dict[str, float] | None] = [None]
    for j in range(1, len(ids)):
        alts = {tok.decode([i]): v for i, v in (s.top[j] if s.top else [])}
        logprob = s.logprobs[j]
        assert logprob is not None, "only token 0 has no logprob"
        alts.setdefault(texts[j], logprob)
        tops.append(alts)
    text = tok.decode(ids, skip_special_tokens=True)
    return text, CompletionLogprobs(tokens=texts, token_logprobs=list(s.logprobs), top_logprobs=tops,
                                    text_offset=offsets, suffix_stderr=s.stderr)


def _joined(prompt: CompletionLogprobs, prompt_text: str, completion: CompletionLogprobs) -> CompletionLogprobs:
    assert prompt.top_logprobs is not None and completion.top_logprobs is not None
    stderr = None if prompt.suffix_stderr is None else prompt.suffix_stderr + [None] * len(completion.tokens)
    return CompletionLogprobs(tokens=prompt.tokens + completion.tokens,
                              token_logprobs=prompt.token_logprobs + completion.token_logprobs,
                              top_logprobs=prompt.top_logprobs + completion.top_logprobs,
                              text_offset=prompt.text_offset + [len(prompt_text) + o for o in completion.text_offset],
                              suffix_stderr=stderr)


async def completions(body: CompletionRequest, request: Request) -> CompletionResponse:
    """POST /v1/completions with echo + logprobs: the prompt's logprobs (then the completion's, if any)."""
    st, t0 = server_state(request.app), time.perf_counter()
    assert body.logprobs is not None, "checked by CompletionRequest"
    k, prompts, tok = body.logprobs, body.prompt_list(), st.prompts.tokenizer
    ids_list, scores, version = await score(st, prompts, "prompt", body, body.likelihood, k)
    to_generate: list[str | list[int]] = list(ids_list)
    seqs = await prepare(st, to_generate, body, body.max_tokens, 1) if body.max_tokens != 0 else []
    if seqs:
        seqs = await run_to_completion(st.engine, request, seqs, num_top_logprobs=k)
    parts = await st.prompts.run(lambda: [_prompt_logprobs(tok, ids, s, k) for ids, s in zip(ids_list, scores)])
    done = await st.prompts.run(lambda: [completion_logprobs(tok, s, k) for s in seqs])
    choices = []
    for i, (text, lp) in enumerate(parts):
        if seqs:
            lp, text = _joined(lp, text, done[i]), text + seqs[i].text
        choices.append(CompletionChoice(index=i, text=text, finish_reason=seqs[i].finish_reason if seqs else "length",
                                        logprobs=lp))
    num_prompt = sum(len(ids) for ids in ids_list)
    num_completion = sum(len(s.completion_ids) for s in seqs)
    st.metrics.observe_request("/v1/completions", 200, time.perf_counter() - t0, num_prompt)
    return CompletionResponse(id=new_id("cmpl"), model=st.engine.model_name, choices=choices,
                              usage=Usage(prompt_tokens=num_prompt, completion_tokens=num_completion,
                                          total_tokens=num_prompt + num_completion),
                              version=max([version] + [s.trace.version for s in seqs]))
