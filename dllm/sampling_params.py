"""A request's sampling parameters and their checks (torch-free: the API processes of `dlrl serve` validate
requests with them without importing torch; dllm.sampling, which samples with them, re-exports both names).

    params = SamplingParams(max_tokens=32, temperature=0.7, seed=1)
    params.validate(block_size)            # FieldError(field, message) naming the bad parameter
    params.is_greedy                       # temperature below GREEDY_BELOW: argmax decoding
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn

from dllm.errors import FieldError
from dllm.logit_bias_rules import check_logit_bias
from dllm.ranges import TEMPERATURE, THRESHOLD, TOP_K, TOP_P
from dllm.strategy import Strategy

GREEDY_BELOW = 1e-5  # temperatures under this floor decode greedily (logits / 1e-38 overflow to inf)


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = TEMPERATURE.default
    top_k: int = int(TOP_K.default)
    top_p: float = TOP_P.default
    strategy: Strategy | str = Strategy.dynamic
    steps: int | None = None
    threshold: float = THRESHOLD.default
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None  # {token id: additive bias} at every forward (dllm.logit_bias)

    def validate(self, block_size: int) -> None:
        def bad(name: str, msg: str) -> NoReturn:
            raise FieldError(name, msg)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature not in TEMPERATURE:
            bad("temperature", f"must be in {TEMPERATURE}, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or self.top_p not in TOP_P:
            bad("top_p", f"must be in {TOP_P}, got {self.top_p!r}")
        if self.strategy not in list(Strategy):
            bad("strategy", f"unknown {self.strategy!r} (known: {', '.join(Strategy)})")
        if self.steps is not None and (not isinstance(self.steps, int) or not 1 <= self.steps <= block_size):
            bad("steps", f"must be an integer in [1, block_size={block_size}], got {self.steps!r}")
        if not isinstance(self.threshold, (int, float)) or self.threshold not in THRESHOLD:
            bad("threshold", f"must be in {THRESHOLD}, got {self.threshold!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        check_logit_bias(self.logit_bias)  # the ids against the vocabulary: dllm.intake.check_request

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def param_row(p: SamplingParams) -> list[float]:
    """A sequence's sampling parameters as numbers (PARAM_FIELDS), for the device-side sampler."""
    return [1.0 if p.is_greedy else float(p.temperature), float(p.top_k), float(p.top_p), float(p.is_greedy)]


PARAM_FIELDS = ("temperature", "top_k", "top_p", "greedy")


def needs_filter(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0
