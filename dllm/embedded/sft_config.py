"""The embedded default's config sections `model` (TinyModelConfig) and `sft` (SFTConfig): torch-free,
so `dlrl <command> --help` and `--check` read them without importing torch (dllm/embedded/sft.py runs SFT).

    arch, sft = TinyModelConfig(hidden_size=64), SFTConfig(steps=300)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dlrl_config import Config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from dllm.weights import DiffusionLM


class TinyModelConfig(Config):
    """Section `model`: the architecture of the embedded default (vocab/mask/eos come from the tokenizer).
    `family` picks the layout and the SFT: `sdar` (block-causal, block-diffusion SFT) or `llada` (full
    attention, LLaDA's SFT: dllm/embedded/sft_full.py). It is left out of `model_dump()` (the other fields
    are the model config's)."""

    family: Literal["sdar", "llada"] = Field("sdar", exclude=True)  # sdar (block-causal) | llada (full attention)
    hidden_size: int = Field(128, ge=1)  # transformer width
    intermediate_size: int = Field(384, ge=1)  # MLP width
    num_hidden_layers: int = Field(2, ge=1)  # layers
    num_attention_heads: int = Field(4, ge=1)  # query heads
    num_key_value_heads: int = Field(2, ge=1)  # key/value heads (GQA)
    head_dim: int = Field(32, ge=1)  # per-head width
    block_size: int = Field(4, ge=1)  # diffusion block size (tokens denoised together)
    rope_theta: float = Field(10000.0, gt=0)  # RoPE base
    max_position_embeddings: int = Field(512, ge=1)  # longest sequence
    tie_word_embeddings: bool = False  # share input and output embeddings


class SFTConfig(Config):
    """Section `sft`: block-diffusion SFT of the embedded default."""

    output_dir: str = "runs/tiny-sft"  # where the SFT model is written (HF layout)
    steps: int = Field(900, ge=1)  # optimizer steps
    batch_size: int = Field(64, ge=1)  # sequences per step
    lr: float = Field(1e-3, gt=0)  # 3e-3 often stalls for hundreds of steps on the loss plateau (~0.93)  # learning rate
    warmup_steps: int = Field(20, ge=0)  # linear learning-rate warm-up steps
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    t_min: float = Field(0.1, gt=0, le=1)  # smallest masking ratio sampled
    seed: int = 0  # seed
    eval_size: int = Field(200, ge=1)  # held-out problems evaluated at the end
    max_new_tokens: int = Field(8, ge=1)  # answer length at evaluation
    num_threads: int = Field(0, ge=0)  # torch CPU threads (0 = default)


class SFTStopped(Exception):
    """The SFT was stopped by a signal; nothing was written (its temporary folder is removed)."""


@dataclass(frozen=True)
class SFTRecipe:
    """What SFT does for one model kind: build the model, draw a batch, its loss, save the folder (the
    held-out accuracy is one for every kind: dllm.embedded.sft.evaluate). `dllm.embedded.sft.BLOCK_RECIPE` (SDAR) and `dllm.embedded.sft_full.FULL_RECIPE` (LLaDA)."""

    tokenizer: Callable[[Path], PreTrainedTokenizerBase]  # writes its files into the folder, returns it
    build: Callable[[TinyModelConfig, PreTrainedTokenizerBase], DiffusionLM]
    batch: Callable[[list[dict], PreTrainedTokenizerBase, TinyModelConfig, SFTConfig, torch.Generator], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    save: Callable[[torch.nn.Module, Path], None]
