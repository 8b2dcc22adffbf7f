"""What every runner checks at its door (dllm.runner.BlockRunner, dllm.full.runner.FullRunner): a prompt
and its parameters, before a sequence is made.

    check_fits(len(prompt_ids), params.max_tokens, max_len)   # FieldError / TooLong naming the field
    check_request(prompt_ids, params, max_len=..., block_size=..., vocab_size=..., mask_id=...)
    seq = runner.new_sequence(prompt_ids, params)             # Intake: validated, then a dllm.sequence.Sequence
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dllm.errors import FieldError, TooLong
from dllm.logit_bias_rules import check_logit_bias
from dllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch: imported when a sequence is made, not by the API processes that only validate
    from dllm.sequence import Sequence


def check_fits(prompt_len: int, max_tokens: int, max_len: int) -> None:
    """A prompt has at least one token and, with max_tokens more, fits in max_len (else FieldError / TooLong)."""
    if not prompt_len:
        raise FieldError("prompt", "must contain at least one token")
    if prompt_len >= max_len:
        raise TooLong("prompt", f"prompt has {prompt_len} tokens; the limit is max_model_len={max_len} "
                                "(prompt + completion)")
    if isinstance(max_tokens, int) and prompt_len + max_tokens > max_len:
        raise TooLong("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                                    f"max_model_len={max_len}")


def check_request(prompt_ids: list[int], params: SamplingParams, *, max_len: int, block_size: int, vocab_size: int,
                  mask_id: int) -> None:
    """FieldError (TooLong when it does not fit) for a prompt or parameters a decoder cannot run."""
    check_fits(len(prompt_ids), params.max_tokens, max_len)
    params.validate(block_size)
    for t in prompt_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size or t == mask_id:
            raise FieldError("prompt_ids", f"invalid token id {t} (vocab {vocab_size}, mask id {mask_id})")
    check_logit_bias(params.logit_bias, vocab_size, mask_id)



class Intake:
    """A runner's door: new sequences and their checks (dllm.full.runner.FullRunner; the API processes' view
    of the engine core's runner, server.core.client). It sets `vocab_size`, `block_size`, `mask_id` and
    `max_len`; no slots or pages (the scheduler's block manager holds those)."""

    vocab_size: int
    block_size: int
    mask_id: int
    max_len: int

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None) -> Sequence:
        """A validated sequence for the scheduler (a plain dllm.sequence.Sequence; a subclass made elsewhere,
        e.g. the server's, works as well); a bad prompt or parameter raises FieldError (TooLong when it does
        not fit)."""
        from dllm.sequence import Sequence

        self.validate(prompt_ids, params)
        return Sequence(prompt_ids, params, self.block_size, self.mask_id, seq_id)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """FieldError (TooLong when it does not fit) for a prompt or parameters this runner cannot run."""
        check_request(prompt_ids, params, max_len=self.max_len, block_size=self.block_size,
                      vocab_size=self.vocab_size, mask_id=self.mask_id)
