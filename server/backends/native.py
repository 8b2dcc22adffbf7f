"""The native backend: dllm's `BlockDecoder` (PyTorch; CPU SDPA, CUDA FlexAttention in bf16).

    backend = NativeBackend.from_pretrained("runs/tiny/model", device="auto", dtype="auto",
                                            max_batch=16, max_model_len=0, trust_remote_code=False)

Generation stops at the union of config.json's, generation_config.json's and the
tokenizer's eos ids (`backend.eos_ids`; chat checkpoints end turns with `<|im_end|>`); a
request's `stop_token_ids` add to them, as in vLLM. The folder's own Python code runs only
with `trust_remote_code=True` (never a prompt on stdin).

The decoder gets its own tokenizer instance (it decodes text and applies stop strings in
the engine thread) while `backend.tokenizer` is used by HTTP handlers on the event loop,
so no tokenizer object is shared between threads.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from dllm.decoding import BlockDecoder, Sequence
from dllm.weights import load_pretrained, parse_dtype
from server.backends.base import Backend

log = logging.getLogger("dlrl.server")
DEFAULT_MAX_LEN = 8192


def resolve_device(device: str) -> torch.device:
    if device in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype in ("", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(dtype)


class NativeBackend(Backend):
    name = "native"

    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int, max_model_len: int = 0,
                 eos_ids: list[int] | None = None):
        cfg = model.config
        self.eos_ids = sorted(set(cfg.eos_ids if eos_ids is None else eos_ids))
        self.model, self.tokenizer = model.eval(), tokenizer
        self.block_size, self.vocab_size, self.mask_token_id = cfg.block_size, cfg.vocab_size, cfg.mask_token_id
        # 0 = the model's limit, capped so the preallocated KV cache of a real SDAR model
        # (max_batch x max_len per layer) stays reasonable; set server.max_model_len to go higher
        self.max_len = max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_LEN)
        self.max_batch = max_batch
        decode_tok = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.decoder = BlockDecoder(model, max_batch=max_batch, max_len=self.max_len, eos_ids=self.eos_ids,
                                    tokenizer=decode_tok)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "auto", dtype: str = "auto",
                        max_batch: int = 16, max_model_len: int = 0, trust_remote_code: bool = False,
                        block_size: int = 0, mask_token_id: int = -1) -> NativeBackend:
        from dllm.tokenizer import eos_token_ids, load_tokenizer

        dev = resolve_device(device)
        model = load_pretrained(path, device=dev, dtype=resolve_dtype(dtype, dev), block_size=block_size or None,
                                mask_token_id=None if mask_token_id < 0 else mask_token_id)
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        log.info("loaded %s on %s (%s, %.1fM params)", path, dev, model.dtype,
                 sum(p.numel() for p in model.parameters()) / 1e6)
        eos_ids = eos_token_ids(path, tokenizer, model.config.eos_ids)
        log.info("stop token ids (config.json + generation_config.json + tokenizer): %s", eos_ids)
        return cls(model, tokenizer, max_batch=max_batch, max_model_len=max_model_len, eos_ids=eos_ids)

    def new_sequence(self, prompt_ids: list[int], params: Any) -> Sequence:
        if params.stop_token_ids is not None and not params.ignore_eos:  # vLLM: they add to the eos ids
            params.stop_token_ids = sorted(set(self.eos_ids) | set(params.stop_token_ids))
        return self.decoder.new_sequence(prompt_ids, params)

    def add(self, seqs: list[Sequence]) -> None:
        self.decoder.add(seqs)

    def step(self, seqs: list[Sequence]) -> list[Sequence]:
        return self.decoder.step(seqs)

    def release(self, seq: Sequence) -> None:
        self.decoder.release(seq)

    @property
    def num_free_slots(self) -> int:
        return self.decoder.num_free_slots

    def close(self) -> None:
        self.decoder.cache = None
