"""The native generation API: POST /generate -> one `Sample` per prompt x n, each with its trace.

    GenerateRequest(prompt=["1+2=", "3+4="], n=4, max_tokens=16, strategy="dynamic", seed=0)
    GenerateResponse(id, model, version, samples=[Sample(..., trace=Trace(...))], usage)

`prompt` (text) or `prompt_ids` (token ids), exactly one, each one prompt or a list; the
decoding options are `common.DecodingOptions`; `Sample.trace` is `dllm.trace.Trace`.
Prompt log-likelihoods: `max_tokens: 0` with `prompt_logprobs: k` (k alternatives per token, 0 = none)
gives each sample's `prompt_logprobs` (None for the first token) and `prompt_top_logprobs`, scored as
`likelihood` says (server.likelihood by default): no tokens are generated.

    GenerateRequest(prompt="12+7=19", max_tokens=0, prompt_logprobs=0, likelihood="sequential")
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dllm.errors import FieldError
from rollout_client.protocol import common
from rollout_client.protocol.common import (
    DecodingOptions,
    Integral,
    Likelihood,
    NonEmptyText,
    Text,
    TokenIds,
    Usage,
)
from rollout_client.protocol.sample import Generated


def _exactly_one_prompt(schema: dict[str, Any]) -> None:
    """JSON schema of GenerateRequest: exactly one of prompt / prompt_ids is given (not null)."""
    schema["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"not": {"type": "null"}},
                                                "prompt_ids": {"type": "null"}}},
        {"required": ["prompt_ids"], "properties": {"prompt_ids": {"not": {"type": "null"}},
                                                    "prompt": {"type": "null"}}},
    ]
    # prompt log-likelihoods: max_tokens 0 <=> prompt_logprobs given (an integer), one sample per prompt
    scoring: dict[str, Any] = {"required": ["prompt_logprobs"], "properties": {"prompt_logprobs": {"type": "integer"}}}
    zero = {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}}
    schema["allOf"] = [{"if": zero, "then": {**scoring, "properties": {
                           **scoring["properties"], "n": {"anyOf": [{"const": 1}, {"type": "null"}]}}}},
                       {"if": scoring, "then": zero}]


class GenerateRequest(DecodingOptions):
    """POST /generate: exactly one of `prompt` (text) or `prompt_ids` (token ids), each one or a list."""

    model_config = ConfigDict(json_schema_extra=_exactly_one_prompt)
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    prompt_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    n: Annotated[int, Field(ge=1, le=common.MAX_N), Integral] | None = 1
    max_tokens: Annotated[int, Field(ge=0, le=common.MAX_TOKENS_CAP), Integral] | None = Field(64, description="default: the server's "
                                   "server.default_max_tokens (capped by the room left after the prompt); 0 with "
                                   "prompt_logprobs: score the prompt only")
    model: Text | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=common.MAX_TOP_LOGPROBS), Integral] | None = Field(
        None, description="with max_tokens 0: every prompt token's logprob and its k most likely alternatives")
    likelihood: Likelihood | None = Field(None, description=common.LIKELIHOOD_DOC)

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise FieldError("prompt", "exactly one of 'prompt' or 'prompt_ids' is required")
        if self.prompt_logprobs is not None and self.max_tokens != 0:
            raise FieldError("max_tokens", "prompt_logprobs scores the prompt only: set max_tokens to 0")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise FieldError("max_tokens", "0 asks for prompt log-likelihoods only: set prompt_logprobs "
                             "(0 = no alternatives), or ask for at least 1 token")
        if self.max_tokens == 0 and self.n != 1:
            raise FieldError("n", "prompt log-likelihoods (max_tokens 0) are one sample per prompt: n must be 1")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """Normalised prompts: each a text or a list of token ids."""
        if self.prompt is not None:
            return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
        ids = self.prompt_ids or []
        if ids and isinstance(ids[0], list):
            return [list(p) for p in ids]
        return [list(ids)]


class Sample(Generated):
    index: int
    prompt_index: int
    num_forwards: int = 0
    prompt_logprobs: list[float | None] | None = Field(None, description="max_tokens 0: each prompt token's "
                                                       "logprob (None for the first)")
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = Field(None, description="per prompt token its "
                                                                       "k most likely (id, logprob)")
    likelihood: Likelihood | None = None
    prompt_logprobs_stderr: list[float | None] | None = Field(
        None, description="elbo: per prompt token the standard error of the estimate of the sum of prompt_logprobs "
                          "from that token to the end (what a harness sums for a continuation starting there; "
                          "squared: the estimator's variance); None for the first token")
    likelihood_samples: int | None = Field(None, description="elbo: Monte Carlo samples per estimate "
                                           "(server.elbo_samples)")


class GenerateResponse(BaseModel):
    id: str
    model: str
    version: int
    samples: list[Sample]
    usage: Usage
