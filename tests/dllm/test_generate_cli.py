"""`dlrl generate` options: `key=value` (the `generate` section), the old `--flag` aliases mapping onto
the same keys, errors naming the key before any model loads, and `--help` listing every key."""

from __future__ import annotations

import json

import pytest

from dllm.generate_cli import ALIASES, GenerateConfig
from dlrl.cli import main


def _check(capsys, *argv: str) -> dict:
    assert main(["generate", "--check", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["GenerateConfig"]


def _error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["generate", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    return err


def test_every_flag_is_an_alias_of_a_key(capsys):
    assert set(ALIASES.values()) == set(GenerateConfig.model_fields)
    flags = _check(capsys, "--model", "m", "--prompt", "a, b", "--prompt", "yes", "--chat", "--max-tokens", "9",
                   "--temperature", "0.5", "--top-k", "4", "--top-p", "0.8", "--strategy", "sequential", "--steps",
                   "3", "--threshold", "0.7", "--seed", "11", "--stop", "x,y", "--dtype", "bfloat16",
                   "--device", "cpu", "--trace")
    keys = _check(capsys, "model=m", "prompt=a, b", "generate.prompt=yes", "chat=true", "max_tokens=9",
                  "temperature=0.5", "top_k=4", "top_p=0.8", "strategy=sequential", "generate.steps=3",
                  "threshold=0.7", "seed=11", "stop=x,y", "dtype=bfloat16", "device=cpu", "trace=true")
    assert flags == keys
    assert keys["prompt"] == ["a, b", "yes"] and keys["stop"] == ["x,y"]  # text as written: no splitting, no YAML
    assert keys["max_tokens"] == 9 and keys["chat"] is True and keys["seed"] == 11


def test_config_file_section_then_overrides(tmp_path, capsys):
    cfg = tmp_path / "gen.yaml"
    cfg.write_text("generate:\n  model: runs/x\n  prompt: ['1+1=']\n  max_tokens: 5\n")
    got = _check(capsys, "--config", str(cfg), "max_tokens=7")
    assert (got["model"], got["prompt"], got["max_tokens"]) == ("runs/x", ["1+1="], 7)
    cfg.write_text("generate:\n  model: runs/x\n  max_token: 5\n")
    err = _error(capsys, "--config", str(cfg), "prompt=1")
    assert f"{cfg}:3: unknown config key 'generate.max_token' (did you mean 'max_tokens'?)" in err


@pytest.mark.parametrize("argv, message", [
    (["model=m", "prompt=1", "max_token=5"], "unknown config key 'generate.max_token' (did you mean 'max_tokens'?)"),
    (["model=m", "prompt=1", "max_tokens=lots"], "config key generate.max_tokens (--max-tokens): Input should be"),
    (["--model", "m", "--prompt", "1", "--top-k", "-1"], "config key generate.top_k (--top-k): Input should be"),
    (["model=m", "prompt=1", "strategy=fast"], "config key generate.strategy (--strategy):"),
    (["model=m", "prompt=1", "device=gpu"], "generate.device (--device): expected auto, cpu, cuda or cuda:N"),
    (["model=m", "prompt=1", "stop="], "generate.stop (--stop): stop strings must be non-empty"),
    (["model=m", "prompt=1", "max_tokens=4", "--max-tokens", "5"],
     "generate.max_tokens (--max-tokens): given both as --max-tokens and as max_tokens=...; use one"),
    (["prompt=1"], "config key generate.model (--model): required"),
    (["model=m"], "config key generate.prompt (--prompt): required"),
    (["model=m", "prompt=1", "train.num_steps=3"], "override 'train.num_steps': unknown section 'train'"),
])
def test_bad_options_are_errors_naming_the_key(capsys, argv, message):
    assert message in _error(capsys, *argv)


def test_help_lists_every_key_and_the_aliases(capsys):
    assert main(["generate", "--help"]) == 0
    text = capsys.readouterr().out
    assert "usage: dlrl generate" in text and "--max-tokens MAX_TOKENS" in text and "alias of max_tokens=VALUE" in text
    keys = {line.split()[0] for line in text.splitlines() if line.startswith("  generate.")}
    assert keys == {f"generate.{k}" for k in GenerateConfig.model_fields}
    assert "generate.max_tokens   int = 64  # tokens to generate per prompt" in text
