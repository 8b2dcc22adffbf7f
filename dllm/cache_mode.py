"""How a full-attention model (LLaDA, Dream) reuses keys and values across a block's forwards (torch-free).

A `str` enum like `dllm.strategy.Strategy`: `"prefix"` and `CacheMode.prefix` are interchangeable, and the
config key `server.cache_mode`, the runner (`dllm.full.runner.FullRunner`), the server's runner and every
trace carry the plain string.

    CacheMode("prefix")          # CacheMode.prefix (repr 'prefix'); ValueError for an unknown mode
    CacheModeField               # the pydantic field type: takes "exact" even in strict models
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Strict


class CacheMode(StrEnum):
    """exact: every forward recomputes every position (the trace replays exactly; the default); prefix: the
    official `use_cache=True`, Fast-dLLM's prefix cache (faster, approximate)."""

    exact = "exact"
    prefix = "prefix"

    def __repr__(self) -> str:  # as the plain string it stands for: error messages quote 'prefix'
        return repr(self.value)


DEFAULT_CACHE_MODE = CacheMode.exact
CACHE_MODES = tuple(CacheMode)  # in the order error messages list them

# strict pydantic models refuse a plain string for an enum (Python input): this field takes the value
CacheModeField = Annotated[CacheMode, Strict(False)]
