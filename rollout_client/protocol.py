"""Wire schemas of the generation API (pydantic v2, no torch): defined once, used by both sides.

The server (`server/`) validates requests and builds responses with these models (and
publishes them in its OpenAPI document); the `RolloutClient` parses responses with them.
Native API: `GenerateRequest` -> `GenerateResponse` (one `Sample` per prompt x n, each with
its decoding `TraceModel` and policy `version`). OpenAI-compatible API: `CompletionRequest`,
`ChatCompletionRequest` and their responses/stream chunks, with the dLLM decoding options
as extra fields. Errors are `ErrorResponse` bodies: `{"error": {"message", "type", "param",
"code"}}` where `param` names the offending field.

Request rules (what the JSON schema says is what the server accepts): `null` for an
optional field means its default; strings must be valid Unicode (a lone surrogate such as
`"\\ud800"` is a 400 naming the field); prompts are non-empty; `/generate` takes exactly one
of `prompt` / `prompt_ids`. Limits that depend on the served model (vocabulary, block size,
context length) are added to the schema by the server (`server.openapi`).

    GenerateRequest(prompt=["1+2=", "3+4="], n=4, max_tokens=16, strategy="dynamic", seed=0)
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

Strategy = Literal["static", "dynamic", "sequential"]
FinishReason = Literal["stop", "length", "abort"]
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


def _valid_unicode(text: str) -> str:
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


def int_range(**limits: int) -> Any:
    """An integer field with bounds (ge/le/lt) that also takes integral numbers such as 3.0."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = int_range(ge=0)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class _NullIsDefault(BaseModel):
    """Strict types; `null` for an optional field means its default (as OpenAI clients send it)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class _Request(_NullIsDefault):
    """Base of the native request bodies: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")


class DecodingOptions(_Request):
    """Block-diffusion sampling options shared by every generation endpoint."""

    temperature: float | None = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int_range(ge=0, lt=1 << 31) | None = Field(0, description="0 = off")
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    strategy: Strategy | None = "dynamic"
    steps: int_range(ge=1) | None = Field(None, description="denoising steps per block (static/sequential); "
                                                      "at most the model's block size")
    threshold: float | None = Field(0.9, ge=0.0, le=1.0, description="confidence threshold (dynamic)")
    seed: int_range(ge=0, lt=1 << 53) | None = Field(None, description="below 2**53: exact in every JSON parser")
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[int_range(ge=0, lt=1 << 31)], Field(max_length=1024)] | None = None
    ignore_eos: bool | None = False
    return_trace: bool | None = True
    timeout: float | None = Field(None, gt=0.0, le=86400.0, description="seconds: a request not finished by "
                                  "then is aborted (503), its cache freed; capped by the server's max_request_s")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# --------------------------------------------------------------------------- native /generate

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
    n: int_range(ge=1, le=MAX_N) | None = 1
    max_tokens: int_range(ge=1, le=MAX_TOKENS_CAP) | None = Field(64, description="default: the server's "
                                   "server.default_max_tokens (capped by the room left after the prompt)")
    model: Text | None = None

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("prompt: exactly one of 'prompt' or 'prompt_ids' is required")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """Normalised prompts: each a text or a list of token ids."""
        if self.prompt is not None:
            return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
        ids = self.prompt_ids or []
        if ids and isinstance(ids[0], list):
            return [list(p) for p in ids]
        return [list(ids)]  # type: ignore[arg-type]


class TraceModel(BaseModel):
    """dllm.trace.Trace on the wire (see docs/DESIGN.md: steps are 1-based within each block), and
    the one home of its block/step arithmetic (used by replay, advantages and metrics)."""

    prompt_len: int
    block_size: int
    steps: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    version: int = 0
    finish_reason: str | None = None
    tail_ids: list[int] = Field(default_factory=list)
    tail_steps: list[int] = Field(default_factory=list)

    def block_of(self, j: int) -> int:
        """Block index of generated token j (blocks are aligned to position 0 of prompt + completion)."""
        return (self.prompt_len + j) // self.block_size

    def global_steps(self, shrink: int = 1) -> list[int]:
        """Per completion token: an id of the denoising forward that committed it, increasing
        in decoding order (block, then step within the block). With `shrink` s, steps
        (k-1)s+1..ks of a block count as one step k (TraceRL's shrunk trajectory)."""
        if shrink < 1:
            raise ValueError(f"shrink: must be >= 1, got {shrink}")
        span = self.block_size + 1  # steps within a block are 1..block_size
        return [self.block_of(j) * span + -(-st // shrink) for j, st in enumerate(self.steps)]

    @property
    def num_forwards(self) -> int:
        """Denoising forwards that committed the generated tokens (the tail included)."""
        gen = self.steps + self.tail_steps
        return len({(self.block_of(j), st) for j, st in enumerate(gen)})


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Sample(BaseModel):
    index: int
    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: FinishReason
    version: int
    num_forwards: int = 0
    trace: TraceModel | None = None
    record_id: str | None = Field(None, description=RECORD_ID_DOC)


class GenerateResponse(BaseModel):
    id: str
    model: str
    version: int
    samples: list[Sample]
    usage: Usage


# --------------------------------------------------------------------------- OpenAI-compatible requests

class StreamOptions(_NullIsDefault):
    include_usage: bool | None = False


class _OpenAIBase(DecodingOptions):
    """Fields common to completions and chat. Unknown OpenAI fields are ignored (as vLLM does)."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    n: int_range(ge=1, le=MAX_N) | None = 1
    max_tokens: int_range(ge=1, le=MAX_TOKENS_CAP) | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_trace: bool | None = False
    user: Text | None = None

    @field_validator("max_tokens", "max_completion_tokens", mode="before", check_fields=False)
    @classmethod
    def _no_scoring_only(cls, v: Any) -> Any:
        if v == 0 and not isinstance(v, bool):
            raise ValueError("0 asks for prompt log-likelihoods only, which a block-diffusion model does not "
                             "compute (it scores no prompt tokens); ask for at least 1 token")
        return v

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _no_echo_logprobs(schema: dict[str, Any]) -> None:
    """JSON schema of CompletionRequest: `echo` and `logprobs` are not both given."""
    schema["not"] = {"required": ["echo", "logprobs"],
                     "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}}}


class CompletionRequest(_OpenAIBase):
    model_config = ConfigDict(json_schema_extra=_no_echo_logprobs)
    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    echo: bool | None = False
    logprobs: int_range(ge=0, le=MAX_COMPLETION_LOGPROBS) | None = Field(
        None, description="return the sampled tokens' logprobs and the k most likely")

    @model_validator(mode="after")
    def _echo_needs_no_prompt_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: echo with logprobs asks for prompt log-likelihoods, which a "
                             "block-diffusion model does not compute; drop echo or logprobs")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], list):
            return [list(x) for x in p]  # type: ignore[arg-type]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_NullIsDefault):
    """An OpenAI content part; only text parts are supported."""
    type: Literal["text"]
    text: Text


Content = Text | Annotated[list[TextPart], Field(min_length=1)]


class _Message(_NullIsDefault):
    name: Text | None = None

    def text(self) -> str:
        content = getattr(self, "content", None)
        if content is None:
            return ""
        return content if isinstance(content, str) else "".join(p.text for p in content)

    def for_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}  # type: ignore[attr-defined]
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key, None) is not None:
                out[key] = getattr(self, key)
        return out


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    """An assistant turn; `content` may be null (a tool-call turn)."""

    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: Text | None = None


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage],  # noqa: UP007
                        Field(discriminator="role")]


class ChatCompletionRequest(_OpenAIBase):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int_range(ge=1, le=MAX_TOKENS_CAP) | None = None
    logprobs: bool | None = False
    top_logprobs: int_range(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        None, description="k most likely tokens per position (used when logprobs is true)")
    add_generation_prompt: bool | None = True


# --------------------------------------------------------------------------- OpenAI-compatible responses

class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: per completion token its text, logprob, the k most likely
    alternatives ({token: logprob}, plus the sampled one) and its character offset in `text`."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None
    version: int | None = None
    trace: TraceModel | None = None
    completion_ids: list[int] | None = None
    record_id: str | None = Field(None, description=RECORD_ID_DOC)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    version: int | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None
    version: int | None = None
    trace: TraceModel | None = None
    completion_ids: list[int] | None = None
    record_id: str | None = Field(None, description=RECORD_ID_DOC)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    version: int | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None
    version: int | None = None
    trace: TraceModel | None = None
    completion_ids: list[int] | None = None
    record_id: str | None = Field(None, description=RECORD_ID_DOC)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dlrl"
    max_model_len: int | None = None
    version: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------- service / admin / errors

class HealthResponse(BaseModel):
    status: str
    model: str
    version: int
    is_paused: bool
    is_draining: bool = False
    num_running: int = 0
    num_waiting: int = 0
    num_free_slots: int | None = None  # free sequence slots (max_batch less running), kept for compatibility
    num_kv_pages_used: int | None = None   # KV-cache pages in use (pages of block_size tokens)
    num_kv_pages_total: int | None = None  # KV-cache pages in all (None: the backend has no paged cache)


class PauseRequest(_Request):
    abort_inflight: bool | None = False


class EngineStatus(BaseModel):
    is_paused: bool
    version: int
    num_running: int
    num_waiting: int


def _reward_xor_label(schema: dict[str, Any]) -> None:
    """JSON schema of FeedbackRequest: exactly one of reward / label is given (not null)."""
    schema["oneOf"] = [
        {"required": ["reward"], "properties": {"reward": {"type": "number"}, "label": {"type": "null"}}},
        {"required": ["label"], "properties": {"label": {"type": "string"}, "reward": {"type": "null"}}},
    ]


class FeedbackRequest(_Request):
    """POST /v1/feedback: a reward for a recorded sample, given as a number or as a label that
    the server maps to one (`server.feedback_labels`, e.g. accept -> 1.0); exactly one of them."""

    model_config = ConfigDict(json_schema_extra=_reward_xor_label)
    id: str = Field(pattern=RECORD_ID_PATTERN, description="the sample's `record_id`")
    reward: Annotated[float, Field(allow_inf_nan=False, ge=-1e6, le=1e6)] | None = None
    label: Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_valid_unicode)] | None = None

    @model_validator(mode="after")
    def _reward_or_label(self) -> FeedbackRequest:
        if (self.reward is None) == (self.label is None):
            raise ValueError("reward: exactly one of 'reward' or 'label' is required")
        return self


class FeedbackResponse(BaseModel):
    id: str
    reward: float
    duplicate: bool = Field(description="true when this record already had this reward (nothing changed)")


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


# --------------------------------------------------------------------------- client-side result

class Rollout(BaseModel):
    """One generated sample as the trainer sees it (built by `RolloutClient` from a `Sample`).
    It is also the replay input: prompt_ids, completion_ids and the trace (steps, behaviour
    logprobs, tail) are all that trace replay needs."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: FinishReason
    version: int
    trace: TraceModel | None = None
    server: str = ""
    record_id: str | None = None

    @property
    def logprobs(self) -> list[float]:
        """Behaviour logprob per completion token (the trace's)."""
        return list(self.trace.logprobs) if self.trace is not None else []

    @classmethod
    def from_sample(cls, s: Sample, start: int, n: int, server: str) -> Rollout:
        """The rollout of sample `s` of a request whose first prompt has global index `start`."""
        return cls(prompt_index=start + s.prompt_index, sample_index=s.index % n, prompt_ids=s.prompt_ids,
                   completion_ids=s.completion_ids, text=s.text, finish_reason=s.finish_reason,
                   version=s.version, trace=s.trace, server=server, record_id=s.record_id)
