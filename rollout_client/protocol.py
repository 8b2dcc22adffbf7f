"""Wire schemas of the generation API (pydantic v2, no torch): defined once, used by both sides.

The server (`server/`) validates requests and builds responses with these models; the
`RolloutClient` parses responses with them. Native API: `GenerateRequest` ->
`GenerateResponse` (one `Sample` per prompt x n, each with its decoding `TraceModel` and
policy `version`). OpenAI-compatible API: `CompletionRequest`, `ChatCompletionRequest` and
their responses/stream chunks, with the dLLM decoding options as extra fields.
Errors are `ErrorResponse` bodies: `{"error": {"message", "type", "param", "code"}}` where
`param` names the offending field.

    GenerateRequest(prompt=["1+2=", "3+4="], n=4, max_tokens=16, strategy="dynamic", seed=0)
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Strategy = Literal["static", "dynamic", "sequential"]
FinishReason = Literal["stop", "length", "abort"]
MAX_TOKENS_CAP = 1 << 20  # schema-level sanity bound; the server enforces its max_model_len
MAX_N = 256


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class DecodingOptions(_Strict):
    """Block-diffusion sampling options shared by every generation endpoint."""

    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    strategy: Strategy = "dynamic"
    steps: int | None = Field(None, ge=1, description="denoising steps per block (static/sequential)")
    threshold: float = Field(0.9, ge=0.0, le=1.0, description="confidence threshold (dynamic)")
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_trace: bool = True

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# --------------------------------------------------------------------------- native /generate

class GenerateRequest(DecodingOptions):
    """POST /generate: exactly one of `prompt` (text) or `prompt_ids` (token ids), each one or a list."""

    prompt: str | list[str] | None = None
    prompt_ids: list[int] | list[list[int]] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int = Field(64, ge=1, le=MAX_TOKENS_CAP)
    model: str | None = None

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
    """dllm.trace.Trace on the wire (see DESIGN.md: steps are 1-based within each block), and
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


class GenerateResponse(BaseModel):
    id: str
    model: str
    version: int
    samples: list[Sample]
    usage: Usage


# --------------------------------------------------------------------------- OpenAI-compatible

class _OpenAIBase(DecodingOptions):
    """Fields common to completions and chat. Unknown OpenAI fields are ignored (as vLLM does)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_trace: bool = False
    user: str | None = None

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)

    def prompt_list(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], list):
            return [list(x) for x in p]  # type: ignore[arg-type]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    """A chat message; `content` may be OpenAI text parts ([{"type": "text", "text": ...}]), joined."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, v: Any) -> Any:
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in v):
            return "".join(str(p.get("text", "")) for p in v)
        return v


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool = False
    add_generation_prompt: bool = True


class ChoiceLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = None
    version: int | None = None
    trace: TraceModel | None = None
    completion_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    version: int | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: dict[str, Any] | None = None
    version: int | None = None
    trace: TraceModel | None = None
    completion_ids: list[int] | None = None


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
    version: int | None = None
    trace: TraceModel | None = None
    completion_ids: list[int] | None = None


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
    num_running: int = 0
    num_waiting: int = 0


class PauseRequest(_Strict):
    abort_inflight: bool = False


class EngineStatus(BaseModel):
    is_paused: bool
    version: int
    num_running: int
    num_waiting: int


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

    @property
    def logprobs(self) -> list[float]:
        """Behaviour logprob per completion token (the trace's)."""
        return list(self.trace.logprobs) if self.trace is not None else []

    @classmethod
    def from_sample(cls, s: Sample, start: int, n: int, server: str) -> Rollout:
        """The rollout of sample `s` of a request whose first prompt has global index `start`."""
        return cls(prompt_index=start + s.prompt_index, sample_index=s.index % n, prompt_ids=s.prompt_ids,
                   completion_ids=s.completion_ids, text=s.text, finish_reason=s.finish_reason,
                   version=s.version, trace=s.trace, server=server)
