"""Block-diffusion SFT for the embedded default (CPU: 1-2 minutes on 2 idle cores, 25 on a loaded box;
it logs its progress with steps/s and the time left, `progress_line`).

    dlrl sft --config configs/tiny.yaml [sft.steps=300 ...]

A full-attention default (`model.family: llada`, configs/tiny_llada.yaml) trains with LLaDA's SFT
instead (dllm/embedded/sft_full.py: one masking rate per sequence, EOS-padded answer window):
`recipe_of(arch)` picks the model, batch, loss, evaluation and save of the family; the loop,
signals and the folder's atomic appearance below are shared.

Loss (sdar): masked-token cross entropy weighted by 1/t, noise only on completion tokens,
each block of each sequence masked at its own rate t ~ U(t_min, 1), blocks aligned to
position 0, in the noisy-copy + clean-copy layout (`SDARForCausalLM.forward_train`).
Writes a Hugging Face-format folder (config.json, safetensors, tokenizer) and
`sft_metrics.json` with the held-out greedy accuracy, into `<output_dir>.tmp` first, renamed
when complete. In the main thread a SIGTERM / SIGINT stops it at the end of the current step
(a second one at once, without a traceback): the `.tmp` folder is removed and `SFTStopped`
raised, which `dlrl sft`, `dlrl serve` and `dlrl train` turn into one line and exit 0.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from dllm.config import SDARConfig
from dllm.decoding import generate
from dllm.embedded.sft_config import SFTConfig, SFTRecipe, SFTStopped, TinyModelConfig
from dllm.embedded.task import ArithmeticTask
from dllm.embedded.tiny import PROGRESS_FILE  # <output_dir>.tmp/progress: the last progress line, for waiters
from dllm.model import SDARForCausalLM
from dllm.sampling import SamplingParams
from dllm.tokenizer import IM_END, build_char_tokenizer, encode
from dllm.weights import DiffusionLM, save_pretrained

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dlrl.sft")


PROGRESS_EVERY_S = 15.0  # a progress line at least this often (and every 50 steps)


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def progress_line(done: int, total: int, loss: float, elapsed_s: float) -> str:
    """`sft step 150/900 loss 0.9312 | 2.1 steps/s | 1 min 11 s elapsed, ~5 min 57 s left`."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    left = f"~{_duration((total - done) / rate)} left" if rate > 0 and done < total else "done"
    return (f"sft step {done}/{total} loss {loss:.4f} | {rate:.1f} steps/s | {_duration(elapsed_s)} elapsed, "
            f"{left}")


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
def evaluate(model: DiffusionLM, tokenizer: PreTrainedTokenizerBase, examples: list[dict], max_new_tokens: int = 8,
             batch_size: int = 100) -> float:
    """Greedy exact-match accuracy, decoded as the server does (dllm.decoding.generate: a full-attention
    model with dllm.full.decoding, exact mode); the model's train / eval mode is left as it was."""
    was_training = model.training
    model.eval()
    correct = 0
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, strategy="static")
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        outs = generate(model, [encode(tokenizer, e["prompt"]) for e in chunk], params, tokenizer)
        correct += sum(o.text.strip() == e["answer"] for o, e in zip(outs, chunk))
    model.train(was_training)
    return correct / max(1, len(examples))


class _Interrupted(BaseException):
    """A second signal: leave the step now (caught by run_sft, never seen by a caller)."""


class _SignalStop:
    """SIGTERM / SIGINT while it is installed: the first asks for a stop at the end of the step,
    the second stops at once (raises _Interrupted in the main thread)."""

    def __init__(self) -> None:
        self.signum = 0
        self.may_interrupt = True  # off once run_sft cleans up: later signals are only noted

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            if self.may_interrupt:
                self.may_interrupt = False
                log.warning("second %s: stopping the SFT now", name)
                raise _Interrupted(name)
            return
        self.signum = signum
        log.warning("%s: stopping the SFT at the end of this step", name)

    @contextmanager
    def installed(self) -> Iterator[_SignalStop]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals are delivered to the main thread only: nothing to install
            return
        previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_sft(arch: TinyModelConfig, task: ArithmeticTask, cfg: SFTConfig) -> dict:
    """Train the embedded default from scratch and save it to cfg.output_dir (SFTStopped on a signal)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    tmp = out.with_name(out.name + ".tmp")
    stop = _SignalStop()
    with stop.installed():
        try:
            return _train_and_save(arch, task, cfg, out, tmp, stop)
        except _Interrupted:
            pass
        finally:
            stop.may_interrupt = False
            if stop.requested:
                shutil.rmtree(tmp, ignore_errors=True)
    raise SFTStopped(f"SFT stopped by {signal.Signals(stop.signum).name}: no model written ({tmp} removed); "
                     "run again to train the embedded default")


BLOCK_RECIPE = SFTRecipe(
    tokenizer=build_char_tokenizer,
    build=lambda arch, tok: SDARForCausalLM(make_model_config(arch, tok)),
    batch=lambda ex, tok, arch, cfg, gen: sft_batch(ex, tok, arch.block_size, cfg.t_min, gen),
    loss=lambda model, batch: diffusion_loss(cast(SDARForCausalLM, model), *batch),
    save=lambda model, path: save_pretrained(cast(SDARForCausalLM, model), path))


def recipe_of(arch: TinyModelConfig) -> SFTRecipe:
    """The SFT of `arch.family`: block-diffusion (sdar) or LLaDA's full-attention SFT (llada)."""
    if arch.family == "sdar":
        return BLOCK_RECIPE
    from dllm.embedded.sft_full import FULL_RECIPE

    return FULL_RECIPE


def _train_and_save(arch: TinyModelConfig, task: ArithmeticTask, cfg: SFTConfig, out: Path, tmp: Path,
                    stop: _SignalStop) -> dict:
    recipe = recipe_of(arch)
    tokenizer = recipe.tokenizer(tmp)
    model = recipe.build(arch, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
                                              * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    gen = torch.Generator().manual_seed(cfg.seed)
    stream = task.stream(cfg.seed)
    t0 = last_log = time.time()
    model.train()
    for step in range(cfg.steps):
        if stop.requested:
            raise SFTStopped(f"SFT stopped by {signal.Signals(stop.signum).name} after step {step}/{cfg.steps}: no model "
                             f"written ({tmp} removed); run again to train the embedded default")
        batch = recipe.batch([next(stream) for _ in range(cfg.batch_size)], tokenizer, arch, cfg, gen)
        loss = recipe.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        now = time.time()
        if step % 50 == 0 or step == cfg.steps - 1 or now - last_log >= PROGRESS_EVERY_S:
            line = progress_line(step + 1, cfg.steps, loss.item(), now - t0)
            log.info("%s", line)
            (tmp / PROGRESS_FILE).write_text(line + "\n")  # for processes waiting on this SFT (dllm.embedded.tiny)
            last_log = now
    train_s = time.time() - t0
    if stop.requested:
        raise SFTStopped(f"SFT stopped by {signal.Signals(stop.signum).name}: no model written ({tmp} removed); "
                         "run again to train the embedded default")
    (tmp / PROGRESS_FILE).write_text(f"sft trained ({cfg.steps} steps): evaluating on the held-out split\n")
    acc = evaluate(model, tokenizer, task.split("heldout", cfg.eval_size), cfg.max_new_tokens)
    metrics = {"heldout_accuracy": acc, "train_seconds": round(train_s, 1), "steps": cfg.steps,
               "final_loss": loss.item(), "num_params": sum(p.numel() for p in model.parameters())}
    (tmp / PROGRESS_FILE).unlink(missing_ok=True)
    recipe.save(model, tmp)
    (tmp / "sft_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if out.exists():  # replace an old model folder, never anything else
        if any(out.iterdir()) and not (out / "config.json").is_file():
            raise FileExistsError(f"sft.output_dir: {out} exists and is not a model folder; not replacing it")
        shutil.rmtree(out)
    tmp.rename(out)  # the folder appears only when complete
    log.info("sft done: held-out greedy accuracy %.1f%% -> %s", 100 * acc, out)
    return metrics
