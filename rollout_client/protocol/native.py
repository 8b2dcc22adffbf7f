"""The native generation API: POST /generate -> one `Sample` per prompt x n, each with its trace.

    GenerateRequest(prompt=["1+2=", "3+4="], n=4, max_tokens=16, strategy="dynamic", seed=0)
    GenerateResponse(id, model, version, samples=[Sample(..., trace=Trace(...))], usage)

`prompt` (text) or `prompt_ids` (token ids), exactly one, each one prompt or a list; the
decoding options are `common.DecodingOptions`; `Sample.trace` is `dllm.trace.Trace`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dllm.errors import FieldError
from rollout_client.protocol import common
from rollout_client.protocol.common import (
    DecodingOptions,
    Integral,
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


class GenerateRequest(DecodingOptions):
    """POST /generate: exactly one of `prompt` (text) or `prompt_ids` (token ids), each one or a list."""

    model_config = ConfigDict(json_schema_extra=_exactly_one_prompt)
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    prompt_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    n: Annotated[int, Field(ge=1, le=common.MAX_N), Integral] | None = 1
    max_tokens: Annotated[int, Field(ge=1, le=common.MAX_TOKENS_CAP), Integral] | None = Field(64, description="default: the server's "
                                   "server.default_max_tokens (capped by the room left after the prompt)")
    model: Text | None = None

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise FieldError("prompt", "exactly one of 'prompt' or 'prompt_ids' is required")
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


class GenerateResponse(BaseModel):
    id: str
    model: str
    version: int
    samples: list[Sample]
    usage: Usage
