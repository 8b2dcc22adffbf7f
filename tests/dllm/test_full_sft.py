"""LLaDA's SFT for the full-attention default (dllm/embedded/sft_full.py): the answer window, one masking
rate per sequence, the 1/t weights, and a loss that trains the tiny LLaDA-layout model."""

from __future__ import annotations

from pathlib import Path

import torch

from dllm.embedded.full_folders import build_family_tokenizer
from dllm.embedded.sft_config import TinyModelConfig
from dllm.embedded.sft_full import full_sft_batch, full_sft_loss, make_full_model
from dllm.embedded.task import ArithmeticTask

ARCH = TinyModelConfig(family="llada", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=8, block_size=4)


def test_batch_masks_the_answer_window_at_one_rate_per_sequence(tmp_path: Path) -> None:
    tok = build_family_tokenizer(tmp_path, "llada")
    examples = ArithmeticTask().split("train", 64)
    b = full_sft_batch(examples, tok, answer_len=8, eps=0.1, gen=torch.Generator().manual_seed(0), block_size=4)
    prompt_len = len(tok.encode(examples[0]["prompt"], add_special_tokens=False))
    assert b.clean.shape == (64, 14)  # the decoder's canvas: prompt 6, then 8 answer tokens (whole blocks of 4)
    assert not b.is_answer[:, :prompt_len].any() and b.is_answer[:, prompt_len:].all()
    answer = [tok.decode(row[prompt_len:prompt_len + 3]) for row in b.clean.tolist()]
    assert answer == [e["answer"] for e in examples]
    assert (b.clean[:, prompt_len + 3:] == tok.eos_token_id).all()  # EOS fills the rest of the window
    masked = b.noisy == tok.mask_token_id
    assert not masked[:, :prompt_len].any() and masked.any() and (~masked[:, prompt_len:]).any()
    assert (b.weights[~masked] == 0).all()
    for i in range(64):  # one weight per sequence: 1 / (p * answer length), p in [eps, 1]
        w = b.weights[i][masked[i]]
        if w.numel():
            assert torch.allclose(w, w[0].expand_as(w)) and 1 / 8 - 1e-6 <= float(w[0]) <= 1 / (0.1 * 8) + 1e-6
    rates = masked[:, prompt_len:].float().mean(1)
    assert rates.std() > 0.15  # rates spread over [eps, 1] by sequence, not one rate for the batch


def test_loss_trains_the_llada_layout_model(tmp_path: Path) -> None:
    tok = build_family_tokenizer(tmp_path, "llada")
    torch.manual_seed(0)
    model = make_full_model(ARCH)
    assert model.family == "llada" and "model.transformer.blocks.0.q_proj.weight" in dict(model.hf_named_tensors())
    assert tok.convert_tokens_to_ids("<|eot_id|>") in model.config.eos_ids  # chat turns end answers too
    b = full_sft_batch(ArithmeticTask().split("train", 32), tok, 8, 0.1, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = full_sft_loss(model, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_recipe_of_the_llada_family_saves_an_official_folder_that_serves(tmp_path: Path) -> None:
    from dllm.embedded.sft import BLOCK_RECIPE, evaluate, recipe_of
    from dllm.embedded.sft_full import FULL_RECIPE
    from dllm.full.model import FullAttentionLM
    from dllm.weights import load_pretrained

    assert recipe_of(TinyModelConfig()) is BLOCK_RECIPE and recipe_of(ARCH) is FULL_RECIPE
    tok = FULL_RECIPE.tokenizer(tmp_path)
    assert tok.mask_token == "<|mdm_mask|>" and tok.eos_token == "<|endoftext|>"
    model = FULL_RECIPE.build(ARCH, tok)
    examples = ArithmeticTask().split("heldout", 3)
    assert 0.0 <= evaluate(model, tok, examples, 8) <= 1.0  # greedy decode of the server's decoder
    FULL_RECIPE.save(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert isinstance(loaded, FullAttentionLM) and loaded.family == "llada" and loaded.config.block_size == 4
    assert all(torch.equal(p, dict(model.hf_named_tensors())[n]) for n, p in loaded.hf_named_tensors())
