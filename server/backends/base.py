"""Backend: the Runner of the engine (device work), so other inference engines can plug in.

The engine's one background thread drives a backend like nano-vllm's ModelRunner:

    seq = backend.new_sequence(prompt_ids, params)   # validate (ValueError "<field>: ...")
    n = backend.num_admissible(waiting)              # how many waiting sequences fit now
    backend.add([seq, ...])                          # allocate slots, prefill prompt blocks
    finished = backend.step(running)                 # one batched denoising forward
    backend.release(seq)                             # free an aborted sequence's slot
    top = backend.top_logprobs(seq, k)               # a finished sequence's top-k logprobs per token

Sequences are `dllm.decoding.Sequence` objects: the backend fills their completion ids,
text, trace (steps, logprobs) and finish_reason. `model` is the torch module whose
parameters the weight-sync receiver updates in place while the engine is paused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (missing package, no GPU, ...)."""


class Backend(ABC):
    name: str = "base"
    model: Any = None       # torch.nn.Module with SDAR parameter names
    tokenizer: Any = None   # the server-side tokenizer (encode prompts, chat template)
    block_size: int = 0
    max_len: int = 0        # longest prompt + completion a sequence may reach
    max_batch: int = 0
    vocab_size: int = 0
    mask_token_id: int = -1

    @abstractmethod
    def new_sequence(self, prompt_ids: list[int], params: Any) -> Any:
        """Validate and build a Sequence; raise ValueError('<field>: <message>') on bad input."""

    @abstractmethod
    def add(self, seqs: list[Any]) -> None:
        """Give each sequence a slot and prefill its prompt."""

    @abstractmethod
    def step(self, seqs: list[Any]) -> list[Any]:
        """One batched forward over `seqs`; returns those that finished (their slots freed)."""

    @abstractmethod
    def release(self, seq: Any) -> None:
        """Free the slot of an aborted sequence (finish_reason becomes 'abort')."""

    @property
    @abstractmethod
    def num_free_slots(self) -> int:
        ...

    def num_admissible(self, waiting) -> int:
        """How many of the waiting sequences, taken in order, can start now (free slots by default;
        the native backend also counts the KV-cache pages each one needs)."""
        return min(len(waiting), self.num_free_slots)

    def top_logprobs(self, seq: Any, k: int) -> list[list[tuple[int, float]]]:
        """For every completion token of the finished `seq`: the k most likely (token id, logprob) of
        the distribution it was sampled from, best first (OpenAI logprobs). Called in the engine
        thread right after `seq` finished, while the weights it was generated with are served."""
        raise NotImplementedError(f"backend {self.name}: top logprobs are not supported")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free device resources."""
