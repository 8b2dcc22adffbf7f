"""Tokenizer, task, SFT and the `dlrl sft` / `dlrl generate` commands."""

import json
import subprocess
import sys

import pytest
import torch

from dllm.embedded.sft import SFTConfig, TinyModelConfig, diffusion_loss, make_model_config, sft_batch
from dllm.embedded.task import ArithmeticTask
from dllm.tokenizer import build_char_tokenizer, load_tokenizer
from dlrl_config import ConfigError, load_section


def test_char_tokenizer_loads_with_autotokenizer(tmp_path):
    build_char_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.mask_token == "<|MASK|>" and tok.eos_token == "<|endoftext|>"
    ids = tok.encode("12+34=46", add_special_tokens=False)
    assert len(ids) == 8 and tok.decode(ids) == "12+34=46"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


def test_task_splits_are_disjoint_and_exact():
    task = ArithmeticTask(max_digits=2)
    train = task.split("train", 2000)
    held = task.split("heldout", 200)
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in held}
    for e in held[:50]:
        a, b = e["prompt"][:-1].split("+")
        assert int(e["answer"]) == int(a) + int(b) and len(e["answer"]) == 3
    assert task.split("heldout", 200) == held
    with pytest.raises(ValueError, match="split"):
        task.split("test", 3)
    assert ArithmeticTask.carry_free_sum(58, 67) == 15


def test_sft_loss_only_on_completion_and_decreases(tmp_path):
    tok = build_char_tokenizer(tmp_path)
    arch = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
    from dllm.model import SDARForCausalLM
    torch.manual_seed(0)
    model = SDARForCausalLM(make_model_config(arch, tok))
    gen = torch.Generator().manual_seed(0)
    examples = ArithmeticTask(max_digits=2).split("train", 32)
    noisy, clean, pos, valid, weights, n = sft_batch(examples, tok, 4, 0.1, gen)
    masked = noisy == tok.mask_token_id
    prompt_len = len(tok.encode(examples[0]["prompt"], add_special_tokens=False))
    assert not masked[:, :prompt_len].any() and masked.any()
    assert torch.all(weights[masked] >= 1.0) and torch.all(weights[~masked] == 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = diffusion_loss(model, noisy, clean, pos, valid, weights, n)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_sft_and_generate_commands(tmp_path):
    out = tmp_path / "sft"
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model:\n  hidden_size: 64\n  intermediate_size: 128\n  num_hidden_layers: 2\n  head_dim: 16\n"
                   f"sft:\n  output_dir: {out}\n  steps: 20\n  eval_size: 10\n")
    run = subprocess.run([sys.executable, "-m", "dlrl.cli", "sft", "--config", str(cfg), "batch_size=16"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    metrics = json.loads((out / "sft_metrics.json").read_text())
    assert 0 <= metrics["heldout_accuracy"] <= 1 and metrics["steps"] == 20
    progress = [line for line in run.stderr.splitlines() if "sft step " in line]  # with its rate and ETA
    assert "sft step 1/20" in progress[0] and "left" in progress[0] and "steps/s" in progress[0], run.stderr
    assert "sft step 20/20" in progress[-1] and progress[-1].endswith("elapsed, done")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    gen = subprocess.run([sys.executable, "-m", "dlrl.cli", "generate", "--model", str(out), "--prompt", "12+34=",
                          "--max-tokens", "6", "--trace"], capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    lines = gen.stdout.strip().splitlines()
    assert lines[0].startswith("12+34=")
    trace = json.loads(lines[1])
    assert len(trace["trace"]["steps"]) == len(trace["completion_ids"]) == len(trace["trace"]["logprobs"])
    bad = subprocess.run([sys.executable, "-m", "dlrl.cli", "generate", "--model", str(out), "--prompt", "1",
                          "--top-p", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "generate.top_p (--top-p)" in bad.stderr and "Traceback" not in bad.stderr


def test_progress_line_has_rate_and_time_left():
    from dllm.embedded.sft import progress_line

    assert progress_line(150, 900, 0.93124, 71.4) == (
        "sft step 150/900 loss 0.9312 | 2.1 steps/s | 1 min 11 s elapsed, ~5 min 57 s left")
    assert progress_line(900, 900, 0.5, 30.0).endswith("30 s elapsed, done")


def test_generate_key_value_and_old_flags_give_the_same_output(tiny_model_dir, capsys):
    """The key=value style and the --flag aliases of `dlrl generate` decode the same: sampled, traced, two prompts."""
    from dlrl.cli import main

    flags = ["--model", tiny_model_dir, "--prompt", "12+34=", "--prompt", "7+8=", "--max-tokens", "8",
             "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--strategy", "static", "--steps", "2",
             "--seed", "7", "--stop", "\n", "--dtype", "float32", "--device", "cpu", "--trace"]
    keys = [f"model={tiny_model_dir}", "prompt=12+34=", "prompt=7+8=", "max_tokens=8", "temperature=0.8",
            "top_k=5", "top_p=0.9", "strategy=static", "steps=2", "seed=7", "stop=\n", "dtype=float32",
            "device=cpu", "trace=true"]
    assert main(["generate", *flags]) == 0
    by_flags = capsys.readouterr().out
    assert main(["generate", *keys]) == 0
    by_keys = capsys.readouterr().out
    lines = by_keys.strip().splitlines()
    assert by_keys == by_flags and len(lines) == 4 and lines[0].startswith("12+34=") and lines[2].startswith("7+8=")
    assert json.loads(lines[1])["trace"]["steps"]
    with pytest.raises(SystemExit) as e:  # steps > the model's block size: refused naming the key, after loading
        main(["generate", f"model={tiny_model_dir}", "prompt=1", "steps=10000"])
    assert e.value.code == 2 and "generate.steps (--steps): must be an integer in [1, block_size=" in \
        capsys.readouterr().err


def test_config_errors_name_the_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sft:\n  steps: many\n")
    with pytest.raises(ConfigError, match="sft.steps"):
        load_section(SFTConfig, cfg, "sft")
    with pytest.raises(ConfigError, match="bogus"):
        load_section(SFTConfig, None, "sft", ["sft.bogus=1"])
    assert load_section(SFTConfig, None, "sft", ["lr=1e-3"]).lr == 1e-3
    assert load_section(SFTConfig, None, "sft", ["lr=5"], bare_keys=False).lr == SFTConfig().lr
