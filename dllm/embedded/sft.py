"""Block-diffusion SFT for the embedded default (CPU, a minute or two on 2 cores).

    dlrl sft --config configs/tiny.yaml [sft.steps=300 ...]

Loss: masked-token cross entropy weighted by 1/t, noise only on completion tokens,
each block of each sequence masked at its own rate t ~ U(t_min, 1), blocks aligned to
position 0, in the noisy-copy + clean-copy layout (`SDARForCausalLM.forward_train`).
Writes a Hugging Face-format folder (config.json, safetensors, tokenizer) and
`sft_metrics.json` with the held-out greedy accuracy.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field

from dllm.config import SDARConfig
from dllm.decoding import generate
from dllm.embedded.task import ArithmeticTask
from dllm.model import SDARForCausalLM
from dllm.sampling import SamplingParams
from dllm.tokenizer import IM_END, build_char_tokenizer, encode
from dllm.weights import save_pretrained
from dlrl_config import Config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dlrl.sft")


class TinyModelConfig(Config):
    """Section `model`: the architecture of the embedded default (vocab/mask/eos come from the tokenizer)."""

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


def make_model_config(arch: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> SDARConfig:
    im_end = tokenizer.convert_tokens_to_ids(IM_END)  # chat turns end with <|im_end|>
    return SDARConfig(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                      eos_token_id=[tokenizer.eos_token_id, im_end], pad_token_id=tokenizer.eos_token_id,
                      torch_dtype="float32", **arch.model_dump())


def sft_batch(examples: list[dict], tokenizer: PreTrainedTokenizerBase, block_size: int, t_min: float,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> noisy [B, L], clean [B, L], pos [B, L], valid [B, L], loss weights [B, L] (1/t on masked)."""
    seqs, comp_starts = [], []
    for ex in examples:
        p = encode(tokenizer, ex["prompt"])
        seqs.append(p + encode(tokenizer, ex["answer"]) + [tokenizer.eos_token_id])
        comp_starts.append(len(p))
    L = math.ceil(max(map(len, seqs)) / block_size) * block_size
    B = len(seqs)
    clean = torch.full((B, L), tokenizer.eos_token_id, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    is_comp = torch.zeros(B, L, dtype=torch.bool)
    for i, (s, c) in enumerate(zip(seqs, comp_starts)):
        end = math.ceil(len(s) / block_size) * block_size  # EOS-padded to the end of its block
        clean[i, :len(s)] = torch.tensor(s)
        valid[i, :end] = True
        is_comp[i, c:end] = True
    t = t_min + (1 - t_min) * torch.rand(B, L // block_size, generator=gen)
    t = t.repeat_interleave(block_size, dim=1)  # [B, L]: one rate per block
    masked = is_comp & (torch.rand(B, L, generator=gen) < t)
    noisy = torch.where(masked, torch.full_like(clean, tokenizer.mask_token_id), clean)
    weights = masked.float() / t
    pos = torch.arange(L).expand(B, L)
    return noisy, clean, pos, valid, weights, is_comp.sum()


def diffusion_loss(model: SDARForCausalLM, noisy: torch.Tensor, clean: torch.Tensor, pos: torch.Tensor,
                   valid: torch.Tensor, weights: torch.Tensor, num_comp: torch.Tensor) -> torch.Tensor:
    logits = model.forward_train(noisy, clean, pos, valid)  # [B, L, V]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), clean.flatten(), reduction="none")
    return (ce * weights.flatten()).sum() / num_comp.clamp(min=1)


@torch.no_grad()
def evaluate(model: SDARForCausalLM, tokenizer: PreTrainedTokenizerBase, examples: list[dict], max_new_tokens: int = 8, batch_size: int = 100) -> float:
    """Greedy exact-match accuracy."""
    model.eval()
    correct = 0
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, strategy="static")
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        outs = generate(model, [encode(tokenizer, e["prompt"]) for e in chunk], params, tokenizer)
        correct += sum(o.text.strip() == e["answer"] for o, e in zip(outs, chunk))
    return correct / max(1, len(examples))


def run_sft(arch: TinyModelConfig, task: ArithmeticTask, cfg: SFTConfig) -> dict:
    """Train the embedded default from scratch and save it to cfg.output_dir."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    tmp = out.with_name(out.name + ".tmp")
    tokenizer = build_char_tokenizer(tmp)
    model = SDARForCausalLM(make_model_config(arch, tokenizer))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
                                              * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    gen = torch.Generator().manual_seed(cfg.seed)
    stream = task.stream(cfg.seed)
    t0 = time.time()
    model.train()
    for step in range(cfg.steps):
        batch = sft_batch([next(stream) for _ in range(cfg.batch_size)], tokenizer, arch.block_size,
                          cfg.t_min, gen)
        loss = diffusion_loss(model, *batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            log.info("sft step %d/%d loss %.4f (%.0fs)", step + 1, cfg.steps, loss.item(), time.time() - t0)
    train_s = time.time() - t0
    acc = evaluate(model, tokenizer, task.split("heldout", cfg.eval_size), cfg.max_new_tokens)
    metrics = {"heldout_accuracy": acc, "train_seconds": round(train_s, 1), "steps": cfg.steps,
               "final_loss": loss.item(), "num_params": sum(p.numel() for p in model.parameters())}
    save_pretrained(model, tmp)
    (tmp / "sft_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if out.exists():  # replace an old model folder, never anything else
        if any(out.iterdir()) and not (out / "config.json").is_file():
            raise FileExistsError(f"sft.output_dir: {out} exists and is not a model folder; not replacing it")
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)  # the folder appears only when complete
    log.info("sft done: held-out greedy accuracy %.1f%% -> %s", 100 * acc, out)
    return metrics
