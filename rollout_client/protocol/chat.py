"""The OpenAI-compatible chat API: POST /v1/chat/completions (messages, responses, stream chunks).

    ChatCompletionRequest(messages=[{"role": "user", "content": "1+2="}], max_completion_tokens=8)
    ChatCompletionResponse(id, model, choices=[ChatChoice(index, message, finish_reason, ...)])
    ChatCompletionChunk(id, model, choices=[ChatChunkChoice(index, delta=ChatDelta(content="3"))])

Messages are told apart by `role`; content is a text or a list of text parts. Per-token
logprobs with the k most likely alternatives (`top_logprobs`) as OpenAI returns them.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, Field, field_validator

from dllm.errors import FieldError
from rollout_client.protocol.common import (
    MAX_TOKENS_CAP,
    MAX_TOP_LOGPROBS,
    FinishReason,
    Integral,
    Neutral,
    StrictRequest,
    Text,
)
from rollout_client.protocol.openai import OPENAI_NEUTRAL, CompletionEnvelope, OpenAIBase
from rollout_client.protocol.sample import SampleExtras


class TextPart(StrictRequest):
    """An OpenAI content part; only text parts are supported."""
    type: Literal["text"]
    text: Text


Content = Text | Annotated[list[TextPart], Field(min_length=1)]


class _Message(StrictRequest):
    """A chat turn: unknown fields are a 400 naming them. An assistant turn a client sends back as OpenAI
    returned it may carry `refusal`, `annotations`, `audio` and `function_call` (null or empty): accepted,
    they are not part of the prompt."""

    NEUTRAL: ClassVar[dict[str, Neutral]] = {}
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

    NEUTRAL: ClassVar[dict[str, Neutral]] = {
        "refusal": Neutral(("",), "refusal: an assistant turn that refused has no text to continue from; drop it"),
        "annotations": Neutral(([],), "annotations: not part of the prompt; send [] or drop them"),
        "audio": Neutral((), "audio: not supported; drop it"),
        "function_call": Neutral((), "function_call: function calls are not supported; drop it"),
    }

    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: Text | None = None


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage],  # noqa: UP007
                        Field(discriminator="role")]


def _null_only(field: str, what: str) -> Neutral:
    return Neutral((), f"{what} is not supported by this server; drop `{field}`")


class ChatCompletionRequest(OpenAIBase):
    NEUTRAL: ClassVar[dict[str, Neutral]] = {
        **OPENAI_NEUTRAL,
        "parallel_tool_calls": Neutral((True, False), ""),  # only with tools, which are refused
        "functions": Neutral(([],), "functions: function calls are not supported (no tool-call parser for "
                                    "block-diffusion output); drop `functions`"),
        "function_call": Neutral(("none",), 'function_call: function calls are not supported; drop it (or send "none")'),
        "modalities": Neutral((["text"],), 'modalities: text only (send ["text"] or drop it)'),
        "audio": _null_only("audio", "audio output"),
        "prediction": _null_only("prediction", "predicted outputs"),
        "reasoning_effort": _null_only("reasoning_effort", "reasoning effort"),
        "web_search_options": _null_only("web_search_options", "web search"),
    }
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CAP), Integral] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), Integral] | None = Field(
        None, description="k most likely tokens per position (used when logprobs is true)")
    add_generation_prompt: bool | None = True
    tools: Annotated[list[Any], Field(max_length=0)] | None = Field(
        None, description="not supported: a non-empty list is a 400 naming `tools`")
    tool_choice: Literal["none"] | None = Field(
        None, description='not supported: anything but "none" is a 400 naming `tool_choice`')

    @field_validator("tools", mode="before")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise FieldError("tools", "tools are not supported by this server (no tool-call parser for "
                             "block-diffusion output); drop `tools`")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v is not None and v != "none":
            raise FieldError("tool_choice", 'tool calls are not supported by this server; drop `tool_choice` (or send '
                             '"none")')
        return v


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


class ChatChoice(SampleExtras):
    index: int
    message: ChatResponseMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(CompletionEnvelope[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    version: int | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(SampleExtras):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(CompletionEnvelope[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
