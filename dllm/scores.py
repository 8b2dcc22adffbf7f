"""Prompt log-likelihood results and methods (torch-free: the API processes of `dlrl serve` answer with them
without importing torch; dllm.likelihood computes them and re-exports these names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Method = Literal["sequential", "elbo"]
METHODS: tuple[Method, ...] = ("sequential", "elbo")


@dataclass
class TokenScores:
    """One text's scores: per token its logprob (None for token 0) and, when asked, its top-k
    alternatives [(id, logprob)] (an empty list for token 0). A Monte Carlo estimate (`elbo`) also gives
    per token the standard error of the sum of the values from that token on (`stderr`; its square is
    the estimator's variance) and the number of samples it averages."""

    logprobs: list[float | None]
    top: list[list[tuple[int, float]]] | None
    num_rows: int  # forward rows this text cost
    stderr: list[float | None] | None = None
    num_samples: int | None = None
