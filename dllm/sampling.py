"""Sampling parameters and the per-token sampling distribution used by block decoding.

`SamplingParams.validate(block_size)` raises ValueError("<field>: <message>").
`sampling_logprobs` returns the log-probabilities a token is drawn from: logits with
the mask token removed, divided by temperature, then top-k and top-p filtered. For
greedy decoding (temperature 0) the distribution is the temperature-1 one and the
argmax is taken. The Trace records log p(token) under exactly this distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STRATEGIES = ("static", "dynamic", "sequential")


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    strategy: str = "dynamic"
    steps: int | None = None
    threshold: float = 0.9
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def validate(self, block_size: int) -> None:
        def bad(name: str, msg: str):
            raise ValueError(f"{name}: {msg}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.strategy not in STRATEGIES:
            bad("strategy", f"unknown {self.strategy!r} (known: {', '.join(STRATEGIES)})")
        if self.steps is not None and (not isinstance(self.steps, int) or not 1 <= self.steps <= block_size):
            bad("steps", f"must be an integer in [1, block_size={block_size}], got {self.steps!r}")
        if not isinstance(self.threshold, (int, float)) or not 0 <= self.threshold <= 1:
            bad("threshold", f"must be in [0, 1], got {self.threshold!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams, mask_token_id: int) -> torch.Tensor:
    """logits: [..., V] -> log-probabilities [..., V] of the sampling distribution (fp32)."""
    logits = logits.float().clone()
    logits[..., mask_token_id] = float("-inf")
    if not params.is_greedy and params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum > params.top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_tokens(logprobs: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs: [L, V] -> (token ids [L], their logprobs [L])."""
    if params.is_greedy:
        ids = logprobs.argmax(-1)
    else:
        ids = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1)
