"""No silent wrong answers (issue 24): `dlrl eval` checks what the server holds against the model
it was asked for and records it; YAML typos are errors naming file, line and nearest key;
`dlrl train` refuses servers of another model (unless train.take_over_servers=true, which
renames them) and an output folder holding a previous run (unless --resume / overwrite=true)."""

import json

import httpx
import pytest

from dllm.export import export_pretrained
from dlrl_config import ConfigError, load_sections
from trainer.config import TrainConfig
from trainer.eval_cli import main as eval_main

TOKEN = "first-day-token"


@pytest.fixture(scope="module")
def other_server(make_server):
    """A server of the tiny model that reports another name ('other-model')."""
    return make_server(admin_token=TOKEN, served_model_name="other-model", max_model_len=128)


def _eval(tmp_path, capsys, *overrides):
    out = tmp_path / "res.json"
    rc = eval_main(["--config", str(tmp_path / "none.yaml"), "start_server=false", "max_tokens=4", "limit=4",
                    "reward=exact_match", f"output={out}", *overrides])
    return rc, capsys.readouterr(), out


def _folder(srv, path, tiny_model_dir, scale=1.0):
    params = {n: p.detach().clone() * scale for n, p in srv.engine.model.hf_named_tensors()}
    return export_pretrained(params.items(), srv.engine.model.config, path, source_dir=tiny_model_dir)


def test_eval_refuses_other_weights_and_records_what_it_evaluated(other_server, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "none.yaml").write_text("eval: {}\n")
    url = other_server.url
    wrong = _folder(other_server, tmp_path / "sft-model", tiny_model_dir, scale=1.01)
    rc, io, out = _eval(tmp_path, capsys, f"servers=[{url}]", f"model={wrong}", f"admin_token={TOKEN}")
    assert rc == 1 and not out.exists()
    assert "serves model 'other-model'" in io.err and f"eval.model={wrong}" in io.err
    assert "checksum" in io.err and "eval.own_server=true" in io.err
    # the same weights in another folder: evaluated, and results.json says what was evaluated
    same = _folder(other_server, tmp_path / "held", tiny_model_dir)
    rc, io, out = _eval(tmp_path, capsys, f"servers=[{url}]", f"model={same}", f"admin_token={TOKEN}")
    assert rc == 0, io.err
    served = json.loads(out.read_text())["served"][url]
    digest = httpx.get(url + "/weights/checksum", headers={"Authorization": f"Bearer {TOKEN}"}).json()["digest"]
    assert served["model"] == "other-model" and served["checksum"] == digest and served["version"] == 0
    assert TOKEN not in out.read_text()
    # without the admin token: checksum cannot be verified -> error naming the keys; verify=name compares names
    rc, io, _ = _eval(tmp_path, capsys, f"servers=[{url}]", f"model={same}")
    assert rc == 2 and "eval.admin_token" in io.err and "eval.verify=name" in io.err
    rc, io, _ = _eval(tmp_path, capsys, f"servers=[{url}]", f"model={same}", "verify=name")
    assert rc == 2 and f"{url} serves 'other-model', not eval.model ('held'" in io.err, io.err  # before loading
    assert "eval.own_server=true" in io.err


def test_yaml_typos_name_file_line_and_nearest_key(tmp_path):
    sections = {"train": TrainConfig}
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# comment\ntrian:\n  num_steps: 5\n")
    with pytest.raises(ConfigError, match=rf"{cfg}:2: unknown section 'trian' \(did you mean 'train'\?\)"):
        load_sections(cfg, [], sections, primary="train")
    cfg.write_text("train:\n  lr: 0.1\n  num_step: 5\n")
    with pytest.raises(ConfigError, match=rf"{cfg}:3: unknown config key 'train.num_step' \(did you mean 'num_steps'"):
        load_sections(cfg, [], sections, primary="train")
    with pytest.raises(ConfigError, match="did you mean 'num_steps'"):
        load_sections(None, ["num_step=3"], sections, primary="train")
    # type errors too (issue 38): file:line for a file's value, one line per error; a command-line value has none
    cfg.write_text("train:\n  lr: 0.1\n  num_steps: many\n  group_size: -2\n")
    with pytest.raises(ConfigError) as e:
        load_sections(cfg, [], sections, primary="train")
    assert str(e.value).splitlines() == [
        f"{cfg}:3: config key train.num_steps: Input should be a valid integer, unable to parse string as an "
        "integer (got 'many')", f"{cfg}:4: config key train.group_size: Input should be greater than or equal to 1 "
        "(got -2)"]
    with pytest.raises(ConfigError) as e:
        load_sections(cfg, ["num_steps=3", "group_size=x"], sections, primary="train")
    assert str(e.value).startswith("config key train.group_size:") and "\n" not in str(e.value)


def _train_config(tmp_path, url, model, **train):
    cfg = {"train": {"servers": [url], "model": model, "output_dir": str(tmp_path / "run"), "num_steps": 1,
                     "prompts_per_step": 2, "group_size": 2, "max_tokens": 4, "eval_every": 0, "admin_token": TOKEN,
                     "start_server": False, "tensorboard": False, **train}}
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_train_refuses_another_model_unless_taking_over(other_server, tiny_model_dir, tmp_path, capsys):
    from trainer.cli import main as train_main

    url = other_server.url
    before = other_server.engine.version
    assert train_main(["--config", _train_config(tmp_path, url, tiny_model_dir)]) == 2  # before anything loads
    err = capsys.readouterr().err
    assert f"{url} serves 'other-model'" in err and "train.take_over_servers=true" in err
    assert other_server.engine.version == before  # untouched
    # a previous run in output_dir: refused before anything loads, unless --resume or overwrite=true
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert train_main(["--config", _train_config(tmp_path, url, tiny_model_dir)]) == 2
    assert "holds a previous run (metrics.jsonl)" in capsys.readouterr().err
    name = tiny_model_dir.rstrip("/").rsplit("/", 1)[-1]
    rc = train_main(["--config", _train_config(tmp_path, url, tiny_model_dir), "take_over_servers=true",
                     "overwrite=true", "eval_every=1", "eval_size=4", "num_steps=2"])
    assert rc == 0
    out = capsys.readouterr().out  # each held-out evaluation, then one summary line
    assert [line.split(":")[0] for line in out.splitlines() if "held-out greedy accuracy" in line][:3] == [
        "step 0", "step 1", "step 2"]
    summary = json.loads(out[out.index("{"):])["summary"]
    assert summary in out.splitlines()  # printed as a line of its own, before the JSON
    assert summary.startswith("done: held-out greedy accuracy ") and " over 2 steps in " in summary
    assert f"outputs in {tmp_path / 'run'}/ (metrics.jsonl, curves.png, final)" in summary
    health = httpx.get(url + "/health").json()
    assert health["model"] == name
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == name
    assert (tmp_path / "run" / "final").is_dir()
