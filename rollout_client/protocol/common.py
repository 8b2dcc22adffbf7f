"""Shared pieces of the wire schemas: field types, request rules, the decoding options, usage.

Request rules (what the JSON schema says is what the server accepts): `null` for an
optional field means its default (`NullIsDefault`); strings must be valid Unicode (a lone
surrogate such as `"\\ud800"` is a 400 naming the field); every request body refuses
unknown fields, as OpenAI does (`StrictRequest`: a 400 naming the field, with "did you mean"
for a near miss; fields of the OpenAI API this server does not implement are accepted only at
their neutral value, `Neutral`); integers also come as integral numbers such as 3.0
(`Integral`). Limits that depend on the served model (vocabulary, block size, context
length) are added to the schema by the server (`server.api.openapi`).

    class MyRequest(StrictRequest):
        count: Annotated[int, Field(ge=1, le=MAX_N), Integral] | None = 1
        text: NonEmptyText
"""

from __future__ import annotations

import difflib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

from dllm.errors import FieldError
from dllm.logit_bias_rules import BOUND as LOGIT_BIAS_BOUND
from dllm.logit_bias_rules import MAX_ENTRIES as LOGIT_BIAS_MAX
from dllm.logit_bias_rules import check_logit_bias
from dllm.options import Temperature, Threshold, TopK, TopP
from dllm.ranges import TEMPERATURE, THRESHOLD, TOP_K, TOP_P
from dllm.strategy import Strategy, StrategyField

FinishReason = Literal["stop", "length", "abort"]
Likelihood = Literal["sequential", "elbo"]  # prompt log-likelihoods: exact sequential policy, or the Monte Carlo ELBO
LIKELIHOOD_DOC = ("how prompt tokens are scored: `sequential` (exact under the sequential decoding policy) or "
                  "`elbo` (Monte Carlo estimate of the masked-diffusion ELBO); default: server.likelihood")
MAX_TOKENS_CAP = 1 << 20  # schema-level sanity bound; the server enforces its max_model_len
MAX_N = 256
MAX_STOP = 16
MAX_COMPLETION_LOGPROBS = 5   # OpenAI's limit for /v1/completions `logprobs`
MAX_TOP_LOGPROBS = 20         # OpenAI's limit for chat `top_logprobs`


RECORD_ID_DOC = ("id of this sample in the server's feedback store (POST /v1/feedback); null when the "
                 "server did not record it (server.record)")
RECORD_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def valid_unicode(text: str) -> str:
    """Reject lone surrogates (JSON `"\\ud800"`): they are not Unicode text and cannot be tokenised."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate (U+{ord(text[e.start]):04X}) at index {e.start}; "
                         "strings must be valid Unicode") from None
    return text


def _integral(value: Any) -> Any:
    """JSON Schema counts 3.0 as an integer; so does this API (strict mode would refuse it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integral = BeforeValidator(_integral)  # in an int field's Annotated: also takes integral numbers such as 3.0


Text = Annotated[str, AfterValidator(valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
TokenId = Annotated[int, Field(ge=0), Integral]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class NullIsDefault(BaseModel):
    """Strict types; `null` for an optional field means its default (as OpenAI clients send it)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


@dataclass(frozen=True)
class Neutral:
    """A field of the OpenAI API this server does not implement: accepted (and dropped) only at one of
    its `values`, where it changes nothing; any other value is a 400 naming it and saying `why`."""

    values: tuple[Any, ...]
    why: str

    def accepts(self, value: Any) -> bool:
        return value is None or any(_same(value, v) for v in self.values)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 0 == 0.0, but false != 0."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if number(a) or number(b):
        return number(a) and number(b) and a == b
    return type(a) is type(b) and a == b


def unknown_field(name: str, known: Iterable[str]) -> FieldError:
    """The 400 of a request field this API does not have: named, with the nearest known name."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return FieldError(name, f"unrecognized request field{hint}; this server refuses fields it does not "
                            "implement rather than ignore them")


class StrictRequest(NullIsDefault):
    """Base of every request body: an unknown field is a 400 naming it (with "did you mean" for a near
    miss), never silently ignored; `NEUTRAL` lists the API's fields this server does not implement,
    accepted only at their neutral value."""

    model_config = ConfigDict(extra="forbid")
    NEUTRAL: ClassVar[dict[str, Neutral]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = {}
        for key, value in data.items():
            if key in cls.model_fields:
                out[key] = value
            elif isinstance(key, str) and key in cls.NEUTRAL:
                if not cls.NEUTRAL[key].accepts(value):
                    raise FieldError(key, cls.NEUTRAL[key].why)
            else:
                try:
                    valid_unicode(str(key))
                except ValueError as e:
                    raise FieldError("body", f"a field name {e}") from None
                raise unknown_field(str(key), [*cls.model_fields, *cls.NEUTRAL])
        return out


LOGIT_BIAS_SCHEMA: dict[str, Any] = {  # the server narrows the ids to its vocabulary (server.api.openapi)
    "type": "object", "maxProperties": LOGIT_BIAS_MAX, "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,9})$"},
    "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_BOUND, "maximum": LOGIT_BIAS_BOUND}}


class DecodingOptions(StrictRequest):
    """Block-diffusion sampling options shared by every generation endpoint."""

    temperature: Temperature | None = Field(TEMPERATURE.default, description="0 = greedy")
    top_k: Annotated[TopK, Integral] | None = Field(int(TOP_K.default), description="0 = off")
    top_p: TopP | None = TOP_P.default
    strategy: StrategyField | None = Strategy.dynamic
    steps: Annotated[int, Field(ge=1), Integral] | None = Field(None, description="denoising steps per block (static/sequential); "
                                                      "at most the model's block size")
    threshold: Threshold | None = Field(THRESHOLD.default, description="confidence threshold (dynamic)")
    seed: Annotated[int, Field(ge=0, lt=1 << 53), Integral] | None = Field(None, description="below 2**53: exact in every JSON parser")
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31), Integral]], Field(max_length=1024)] | None = None
    ignore_eos: bool | None = False
    return_trace: bool | None = True
    logit_bias: Annotated[dict[int, float] | None, BeforeValidator(check_logit_bias),
                          WithJsonSchema({"anyOf": [LOGIT_BIAS_SCHEMA, {"type": "null"}]})] = Field(
        None, description=f"{{token id: bias}}: added to that token's logit at every denoising forward, before "
        f"temperature / top-k / top-p (-100 bans the token, +100 forces it); biases in [-100, 100], at most "
        f"{LOGIT_BIAS_MAX} entries, ids in the vocabulary (not the mask token); recorded in the trace")
    timeout: float | None = Field(None, gt=0.0, le=86400.0, description="seconds: a request not finished by "
                                  "then is aborted (503), its cache freed; capped by the server's max_request_s")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
