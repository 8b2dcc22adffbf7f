"""The OpenAI-compatible completions API: POST /v1/completions, GET /v1/models.

    CompletionRequest(prompt="1+2=", max_tokens=8, stream=True, logprobs=2)
    CompletionResponse(id, model, choices=[CompletionChoice(index, text, finish_reason, ...)])

`OpenAIBase` holds what completions and chat (`protocol.chat`) share: OpenAI's fields plus the
dLLM decoding options (`common.DecodingOptions`) as extra fields. As OpenAI does, an unknown field
is a 400 naming it (with "did you mean" for a near miss); OpenAI fields this server does not
implement (`OPENAI_NEUTRAL`: penalties, response_format, best_of, suffix, ...) are
accepted only at their neutral value, else a 400 saying why. Each choice may also carry its
`version`, `trace` and `record_id`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dllm.errors import FieldError
from rollout_client.protocol.common import (
    LIKELIHOOD_DOC,
    MAX_COMPLETION_LOGPROBS,
    MAX_N,
    MAX_TOKENS_CAP,
    DecodingOptions,
    FinishReason,
    Integral,
    Likelihood,
    Neutral,
    NonEmptyText,
    StrictRequest,
    Text,
    TokenIds,
    Usage,
)
from rollout_client.protocol.sample import SampleExtras


class StreamOptions(StrictRequest):
    include_usage: bool | None = Field(False, description="a last chunk with the request's usage")
    continuous_usage_stats: bool | None = Field(False, description="usage in every chunk (as vLLM): the "
                                                "choice's prompt and its completion tokens so far")


def _unsupported(field: str, what: str) -> str:
    return f"{what}; drop `{field}`"


OPENAI_NEUTRAL = {  # OpenAI fields not implemented here: accepted at the value that changes nothing
    "frequency_penalty": Neutral((0,), _unsupported("frequency_penalty", "frequency penalties are not supported "
                                                    "(only 0)")),
    "presence_penalty": Neutral((0,), _unsupported("presence_penalty", "presence penalties are not supported (only 0)")),
    "response_format": Neutral(({"type": "text"},), "response_format: constrained decoding (JSON mode, JSON schema) "
                               "is not supported: block diffusion commits several tokens per forward in parallel and "
                               'no grammar constrains them; send {"type": "text"} or drop `response_format`'),
    "store": Neutral((False,), _unsupported("store", "this server does not store completions for OpenAI's "
                                            "evals / distillation (server.record is its own recording; only false)")),
    "metadata": Neutral(({},), _unsupported("metadata", "metadata goes with `store`, which is not supported")),
    "service_tier": Neutral(("auto", "default"), _unsupported("service_tier", "one service tier here "
                                                              "(only \"auto\" or \"default\")")),
}


class OpenAIBase(DecodingOptions):
    """Fields common to completions and chat: unknown fields are a 400 naming them, as OpenAI answers."""

    NEUTRAL: ClassVar[dict[str, Neutral]] = OPENAI_NEUTRAL
    model: Text | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), Integral] | None = 1
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CAP), Integral] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_trace: bool | None = False
    user: Text | None = None

    @field_validator("max_tokens", "max_completion_tokens", mode="before", check_fields=False)
    @classmethod
    def _no_scoring_only(cls, v: Any) -> Any:
        if v == 0 and not isinstance(v, bool):
            raise ValueError("0 asks for prompt log-likelihoods only, which chat does not give: use "
                             "/v1/completions with echo and logprobs (or POST /generate with prompt_logprobs), or "
                             "ask for at least 1 token")
        return v

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _scoring_schema(schema: dict[str, Any]) -> None:
    """JSON schema of CompletionRequest: `max_tokens: 0` needs echo + logprobs; echo + logprobs is one
    choice (n 1), not streamed."""
    scoring = {"required": ["echo", "logprobs"], "properties": {"echo": {"const": True},
                                                                "logprobs": {"type": "integer"}}}
    schema["allOf"] = [
        {"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}}, "then": scoring},
        {"if": scoring, "then": {"properties": {"n": {"anyOf": [{"const": 1}, {"type": "null"}]},
                                                "stream": {"not": {"const": True}}}}},
    ]


class CompletionRequest(OpenAIBase):
    """With `echo` and `logprobs` it scores the prompt (prompt log-likelihoods, as lm-eval-harness's
    local-completions asks), then generates `max_tokens` (0: none); `likelihood` picks how the prompt
    is scored (server.likelihood by default)."""

    NEUTRAL: ClassVar[dict[str, Neutral]] = {
        **OPENAI_NEUTRAL,
        "best_of": Neutral((1,), _unsupported("best_of", "best_of is not supported (only 1): ask for n samples and "
                                              "rank them yourself")),
        "suffix": Neutral(("",), _unsupported("suffix", "suffix (insertion) is not supported (only \"\" or null)")),
    }

    model_config = ConfigDict(json_schema_extra=_scoring_schema)
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_CAP), Integral] | None = Field(
        None, description="0 (with echo and logprobs): score the prompt only")
    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), Integral] | None = Field(
        None, description="return the sampled tokens' logprobs and the k most likely")
    likelihood: Likelihood | None = Field(None, description=LIKELIHOOD_DOC)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _no_scoring_only(cls, v: Any) -> Any:
        return v  # 0 is prompt scoring here: checked with echo and logprobs below

    @model_validator(mode="after")
    def _scoring_shape(self) -> CompletionRequest:
        if self.is_scoring():
            if self.stream:
                raise FieldError("stream", "prompt log-likelihoods (echo with logprobs) are not streamed")
            if self.n != 1:
                raise FieldError("n", "prompt log-likelihoods (echo with logprobs) are one choice per prompt: "
                                 "n must be 1")
        elif self.max_tokens == 0:
            raise FieldError("max_tokens", "0 asks for prompt log-likelihoods only: send echo=true with logprobs "
                             "(or ask for at least 1 token)")
        return self

    def is_scoring(self) -> bool:
        """echo + logprobs: the request scores its prompt (prompt log-likelihoods)."""
        return bool(self.echo) and self.logprobs is not None

    def prompt_list(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], list):
            return [list(x) for x in p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: per completion token its text, logprob, the k most likely
    alternatives ({token: logprob}, plus the sampled one) and its character offset in `text`."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing to condition on)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]
    suffix_stderr: list[float | None] | None = Field(
        None, description="echo with likelihood elbo: per prompt token the standard error of the estimate of the sum "
                          "of token_logprobs from that token to the prompt's end (squared: the estimator's variance)")


class CompletionChoice(SampleExtras):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


C = TypeVar("C", bound=BaseModel)  # a choice type


class CompletionEnvelope(BaseModel, Generic[C]):
    """What every OpenAI completion answer (text or chat, whole or a stream's chunk) wraps its choices in; a
    subclass names its `object` (a Literal) and its choice type."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[C]
    usage: Usage | None = None


class CompletionResponse(CompletionEnvelope[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"
    version: int | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dlrl"
    max_model_len: int | None = None
    version: int | None = Field(None, description="the weight version served: 0 = the weights loaded at start, "
                                "each update pushed in place (dlrl train) a larger one")
    weights_run_id: str | None = Field(None, description="the run that pushed the served weights (its run_id, "
                                       "e.g. tiny-rl-1a2b3c4d); null: the weights loaded at start")
    family: str | None = None      # model family: sdar (block-causal) | llada | dream (full attention)
    cache_mode: str | None = None  # full attention: exact | prefix (the decoder's KV reuse; every trace records it)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
