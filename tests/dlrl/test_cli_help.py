"""`dlrl <command> --help` lists every config key (type, default, help) generated from the pydantic
models; `dlrl config show` prints the resolved config as YAML that loads back."""

import pytest
import yaml

from dlrl_config import load_sections
from trainer.config import TrainConfig
from trainer.eval_cli import EvalConfig


@pytest.fixture
def _dlrl(capsys):
    from dlrl.cli import main

    def run(*argv: str) -> str:
        assert main(list(argv)) == 0
        return capsys.readouterr().out
    return run


def test_help_lists_every_key_with_type_default_and_help(_dlrl):
    text = _dlrl("train", "--help")
    assert "usage: dlrl train" in text and "--check" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  train.")}
    assert set(lines) == {f"train.{k}" for k in TrainConfig.model_fields}
    assert "train.num_steps" in lines and "int = 60  # RL steps" in lines["train.num_steps"]
    assert 'tracerl|dipo|random_masking|coupled = "tracerl"' in lines["train.objective"]
    assert all("  # " in line for line in lines.values()), [k for k, v in lines.items() if "  # " not in v]
    assert "  server.port " in text and "  model.hidden_size " in text  # the other sections train reads
    text = _dlrl("eval", "--help")
    assert {f"  eval.{k} " for k in EvalConfig.model_fields} <= {line[:len(line.split()[0]) + 3]
                                                               for line in text.splitlines() if line.strip()}


def test_versions_help_lists_the_align_keys_and_its_alias(_dlrl):
    from trainer.align.config import AlignConfig

    text = _dlrl("versions", "--help")
    assert "usage: dlrl versions" in text and "alias of align.store=PATH" in text and "--rollback VERSION" in text
    assert {line.split()[0] for line in text.splitlines() if line.startswith("  align.")} == {
        f"align.{k}" for k in AlignConfig.model_fields}


def test_config_show_prints_the_resolved_config(_dlrl, tmp_path):
    text = _dlrl("config", "show", "--command", "train", "num_steps=7", "server.admin_token=s3cret")
    assert "s3cret" not in text
    data = yaml.safe_load(text)
    assert data["train"]["num_steps"] == 7 and data["train"]["output_dir"] == "runs/tiny-rl"
    assert set(data) == {"train", "model", "task", "sft", "server"}
    data["server"]["admin_token"] = ""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))  # loads back as it is
    root = load_sections(tmp_path / "c.yaml", [], {"train": TrainConfig}, primary="train")
    assert root["train"].num_steps == 7
