"""Full-attention SFT (LLaDA's recipe) for the embedded default when `model.family` is a
full-attention family (configs/tiny_llada.yaml):

    dlrl sft --config configs/tiny_llada.yaml [sft.steps=300 ...]

Each training sequence is the prompt, then its answer window: the answer, EOS, and EOS again up to the
decoder's canvas (the prompt, then `sft.max_new_tokens` to whole blocks from the prompt's end: dllm.full.decoding's
`canvas_len`, every position of which a full-attention decode sees), so SFT shows the model the shape it decodes; the trailing
EOS are answer tokens, as in LLaDA's SFT, and teach it where to stop. Per SEQUENCE one masking ratio
p = eps + (1 - eps) t, t ~ U(0, 1) (LLaDA's `forward_process`, eps = `sft.t_min`): every answer
token is masked with probability p, the prompt never. Loss: cross entropy of the masked tokens
weighted 1/p, summed per sequence and divided by its answer length, averaged over the batch
(LLaDA's SFT loss: an upper bound of the answer's negative log-likelihood).

The model is anything called as `model(input_ids [B, L], position_ids=pos [B, L]) -> logits
[B, L, V]` with bidirectional attention, where `logits[:, i]` scores the token AT position i (a
family whose raw head predicts the next token, Dream, aligns its logits itself:
`aligned_logits`). Nothing here knows a layout.

    batch = full_sft_batch(examples, tokenizer, answer_len=8, eps=0.1, gen=gen, block_size=4)
    loss = full_sft_loss(model, batch)
    model = make_full_model(arch)                      # the tiny LLaDA-layout model of `model.family: llada`
    FULL_RECIPE                                        # what dllm/embedded/sft.py runs for it
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dllm.embedded.sft_config import SFTRecipe
from dllm.tokenizer import encode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllm.embedded.sft_config import TinyModelConfig
    from dllm.full.config import FullAttentionConfig
    from dllm.full.model import FullAttentionLM


@dataclass
class FullSFTBatch:
    noisy: torch.Tensor  # [B, L] long: answer tokens masked at the sequence's rate
    clean: torch.Tensor  # [B, L] long
    pos: torch.Tensor  # [B, L] long
    weights: torch.Tensor  # [B, L] float: 1 / (p * answer length) on masked answer tokens, 0 elsewhere
    is_answer: torch.Tensor  # [B, L] bool: the answer window (answer + EOS padding)


def answer_window(examples: list[dict], tokenizer: PreTrainedTokenizerBase, answer_len: int,
                  block_size: int = 1) -> tuple[list[list[int]], list[int]]:
    """-> (prompt + answer window ids per example, prompt lengths). The window is the answer, then EOS up
    to the canvas: the prompt, then `answer_len` tokens rounded up to whole blocks from the prompt's end, as
    dllm.full.decoding's canvas (at least one EOS: longer answers keep theirs whole)."""
    eos = tokenizer.eos_token_id
    seqs, prompt_lens = [], []
    for ex in examples:
        prompt, answer = encode(tokenizer, ex["prompt"]), encode(tokenizer, ex["answer"]) + [eos]
        canvas = len(prompt) + -(-answer_len // block_size) * block_size
        answer += [eos] * (canvas - len(prompt) - len(answer))
        seqs.append(prompt + answer)
        prompt_lens.append(len(prompt))
    return seqs, prompt_lens


def full_sft_batch(examples: list[dict], tokenizer: PreTrainedTokenizerBase, answer_len: int, eps: float,
                   gen: torch.Generator, block_size: int = 1) -> FullSFTBatch:
    """LLaDA's forward process over the answer windows of `examples` (one rate per sequence).
    Sequences shorter than the longest get more EOS at the end (part of their answer)."""
    seqs, prompt_lens = answer_window(examples, tokenizer, answer_len, block_size)
    B, L = len(seqs), max(map(len, seqs))
    clean = torch.full((B, L), tokenizer.eos_token_id, dtype=torch.long)
    is_answer = torch.zeros(B, L, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        clean[i, :len(s)] = torch.tensor(s)
        is_answer[i, p:] = True
    p_mask = eps + (1 - eps) * torch.rand(B, 1, generator=gen)  # [B, 1]: one rate per sequence
    masked = is_answer & (torch.rand(B, L, generator=gen) < p_mask)
    noisy = torch.where(masked, torch.full_like(clean, tokenizer.mask_token_id), clean)
    answer_lens = is_answer.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    weights = masked.float() / (p_mask * answer_lens)
    return FullSFTBatch(noisy, clean, torch.arange(L).expand(B, L), weights, is_answer)


def aligned_logits(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """logits [B, L, V] where position i scores the token at i, from a full-attention model."""
    return model(input_ids, position_ids=position_ids)


def full_sft_loss(model: Any, batch: FullSFTBatch) -> torch.Tensor:
    """LLaDA's SFT loss: sum over masked answer tokens of CE / p / answer length, mean over sequences."""
    logits = aligned_logits(model, batch.noisy, batch.pos)  # [B, L, V]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.clean.flatten(), reduction="none")  # [B*L]
    return (ce * batch.weights.flatten()).sum() / batch.noisy.shape[0]



def make_full_config(arch: TinyModelConfig) -> FullAttentionConfig:
    """The official-layout config of the tiny full-attention default (`arch.family`): the family's tiny
    tokenizer's special ids (dllm.embedded.full_folders), `arch`'s shapes, fp32; the chat end token
    (`<|eot_id|>`) ends answers too, as in LLaDA's generation_config."""
    from dllm.embedded.full_folders import tiny_full_config, tokenizer_vocab

    cfg = tiny_full_config(arch.family, **arch.model_dump())
    cfg.eos_token_id = [*cfg.eos_ids, tokenizer_vocab(arch.family)["<|eot_id|>"]]
    return cfg


def make_full_model(arch: TinyModelConfig) -> FullAttentionLM:
    from dllm.full.model import FullAttentionLM

    return FullAttentionLM(make_full_config(arch))


def save_full(model: torch.nn.Module, path: Path) -> None:
    """The official LLaDA layout (config.json, generation_config.json, safetensors) next to the tokenizer."""
    from dllm.full.load import save_full_pretrained
    from dllm.full.model import FullAttentionLM

    assert isinstance(model, FullAttentionLM)
    save_full_pretrained(model, path)


def _recipe() -> SFTRecipe:
    from dllm.embedded.full_folders import build_family_tokenizer

    return SFTRecipe(
        tokenizer=lambda path: build_family_tokenizer(path, "llada"),
        build=lambda arch, tok: make_full_model(arch),
        batch=lambda ex, tok, arch, cfg, gen: full_sft_batch(ex, tok, cfg.max_new_tokens, cfg.t_min, gen,
                                                             arch.block_size),
        loss=full_sft_loss,
        save=save_full)


FULL_RECIPE = _recipe()  # LLaDA's SFT of the full-attention default (dllm/embedded/sft.py runs it)
