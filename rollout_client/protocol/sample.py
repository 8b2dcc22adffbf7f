"""The generated sample's fields, declared once: the base models every wire class that carries a
sample builds on, and the one converter from anything holding them (a wire `Sample`, a stored
record) to the trainer's `Rollout`.

    class Sample(Generated): index: int; ...             # native: the whole sample
    class ChatChoice(SampleExtras): index: int; ...      # OpenAI choices: the dLLM fields, each optional
    Rollout.copy_from(sample, prompt_index=8, sample_index=0, server=url)   # shared fields by name
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, Field

from dllm.trace import Trace
from rollout_client.protocol.common import RECORD_ID_DOC, FinishReason


class Generated(BaseModel):
    """One generated sample: its token ids, text, why it ended, the policy version that generated
    it, its decoding trace (when asked for) and its id in the server's feedback store."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: FinishReason
    version: int
    trace: Trace | None = None
    record_id: str | None = Field(None, description=RECORD_ID_DOC)

    @classmethod
    def copy_from(cls, src: object, **fields: Any) -> Self:
        """`cls` with the fields of `Generated` that `src` holds read by name, `fields` on top
        (validated like any input: `src` may be a stored record read back from a database)."""
        shared = {name: getattr(src, name) for name in Generated.model_fields if hasattr(src, name)}
        return cls.model_validate({**shared, **fields})


class SampleExtras(BaseModel):
    """The dLLM fields an OpenAI-compatible choice (or stream chunk choice) may carry beside
    OpenAI's own: each null unless asked for (`return_trace`) or known (`record_id`)."""

    version: int | None = None
    trace: Trace | None = None
    completion_ids: list[int] | None = None
    record_id: str | None = Field(None, description=RECORD_ID_DOC)
