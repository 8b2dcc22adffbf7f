"""The feedback API: POST /v1/feedback gives a recorded sample (its `record_id`) a reward.

    FeedbackRequest(id="gen-1a2b:0", reward=1.0)     # or label="accept" (server.feedback_labels)
    FeedbackResponse(id="gen-1a2b:0", reward=1.0, duplicate=False)
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from dllm.errors import FieldError
from rollout_client.protocol.common import RECORD_ID_PATTERN, StrictRequest, valid_unicode


def _reward_xor_label(schema: dict[str, Any]) -> None:
    """JSON schema of FeedbackRequest: exactly one of reward / label is given (not null)."""
    schema["oneOf"] = [
        {"required": ["reward"], "properties": {"reward": {"type": "number"}, "label": {"type": "null"}}},
        {"required": ["label"], "properties": {"label": {"type": "string"}, "reward": {"type": "null"}}},
    ]


class FeedbackRequest(StrictRequest):
    """POST /v1/feedback: a reward for a recorded sample, given as a number or as a label that
    the server maps to one (`server.feedback_labels`, e.g. accept -> 1.0); exactly one of them."""

    model_config = ConfigDict(json_schema_extra=_reward_xor_label)
    id: str = Field(pattern=RECORD_ID_PATTERN, description="the sample's `record_id`")
    reward: Annotated[float, Field(allow_inf_nan=False, ge=-1e6, le=1e6)] | None = None
    label: Annotated[str, Field(min_length=1, max_length=64), AfterValidator(valid_unicode)] | None = None

    @model_validator(mode="after")
    def _reward_or_label(self) -> FeedbackRequest:
        if (self.reward is None) == (self.label is None):
            raise FieldError("reward", "exactly one of 'reward' or 'label' is required")
        return self


class FeedbackResponse(BaseModel):
    id: str
    reward: float
    duplicate: bool = Field(description="true when this record already had this reward (nothing changed)")
