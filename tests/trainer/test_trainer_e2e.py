"""End-to-end RL against a real `dlrl serve` process: weights change, versions, checksums,
resume, and bad configs that stop with an error naming the cause."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from dllm.weights import load_pretrained
from tests.helpers import free_port, served_process, write_train_config
from weight_sync import weights_digest

TOKEN = "e2e-token"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """A real server subprocess on a free port."""
    with served_process(tiny_model_dir, TOKEN, tmp_path_factory.mktemp("srv")) as srv:
        yield srv.url


def admin(url: str, path: str) -> dict:
    return httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()


def write_config(tmp: Path, url: str, model: str, **train) -> Path:
    return write_train_config(tmp, [url], model, TOKEN, **train)


def run_train(config: Path, *overrides: str) -> int:
    from trainer.cli import main
    return main(["--config", str(config), *overrides])


def test_two_steps_change_every_param_and_sync_the_server(served, tiny_model_dir, tmp_path):
    v0 = admin(served, "/weights/version")["version"]
    before = dict(load_pretrained(tiny_model_dir).hf_named_tensors())
    assert run_train(write_config(tmp_path, served, tiny_model_dir)) == 0
    final = load_pretrained(tmp_path / "run" / "final")
    changed = {n: not torch.equal(p, before[n]) for n, p in final.hf_named_tensors()}
    assert all(changed.values()), [n for n, c in changed.items() if not c]
    assert admin(served, "/weights/version")["version"] == v0 + 2
    assert admin(served, "/weights/checksum")["digest"] == weights_digest(final.hf_named_tensors())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "time_rollout", "time_train", "time_sync", "tokens_per_forward", "staleness"):
        assert key in rows[-1]
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("overrides", [
    ["objective=dipo", "kl_coef=0.1", "sync_transport=http"],
    # objective=random_masking alone: tests/trainer/test_trace_free.py (from trace-free rollouts)
    ["objective=coupled", "sync_transport=dist"],
    ["use_value_model=true", "gamma=1.0", "lam=0.95", "norm=sequence"],
    ["zero_stage=2", "shrink=2", "updates_per_step=2", "grad_accum=2"],
    ["is_correction=tis", "is_level=sequence", "logprob_chunk=3"],
    ["zero_stage=3", "objective=dipo", "kl_coef=0.1", "is_correction=mis", "use_value_model=true"],
])
def test_objectives_and_options_run_end_to_end(served, tiny_model_dir, tmp_path, overrides):
    v0 = admin(served, "/weights/version")["version"]
    assert run_train(write_config(tmp_path, served, tiny_model_dir, num_steps=1), *overrides) == 0
    final = load_pretrained(tmp_path / "run" / "final")
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    # +1 for the step, +1 more when the run first synced the server to its starting weights
    assert admin(served, "/weights/version")["version"] == row["version"] in (v0 + 1, v0 + 2)
    assert admin(served, "/weights/checksum")["digest"] == weights_digest(final.hf_named_tensors())
    assert row["num_rows"] > 0 and "pg_loss" in row
    if "use_value_model=true" in overrides:
        assert "value_loss" in row
    if "kl_coef=0.1" in overrides:
        assert "kl_ref" in row
    if not any(o in overrides for o in ("objective=random_masking", "objective=coupled")):
        assert "mismatch_abs_mean" in row and "mismatch_abs_max" in row  # train-serve mismatch, every step
    if any(o.startswith("is_correction") for o in overrides):
        assert "is_weight_mean" in row and row["mismatch_abs_max"] < 1e-3  # fp32 server == fp32 trainer


def test_resume_after_a_crash(served, tiny_model_dir, tmp_path):
    cfg = write_config(tmp_path, served, tiny_model_dir, checkpoint_every=1, num_steps=1)
    assert run_train(cfg) == 0
    v1 = admin(served, "/weights/version")["version"]
    assert run_train(cfg, "num_steps=3", "--resume") == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    versions = [r["version"] for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert admin(served, "/weights/version")["version"] > v1


def test_overlap_mode_bounds_staleness(served, tiny_model_dir, tmp_path):
    assert run_train(write_config(tmp_path, served, tiny_model_dir, mode="overlap", num_steps=3)) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in rows][1:] and max(r["staleness"] for r in rows) <= 1


@pytest.mark.parametrize("override,message", [
    ("objective=ppo2", "objective"),
    ("reward=nowhere.module:fn", "nowhere.module"),
    ("mode=async", "mode"),
    ("no_such_key=1", "no_such_key"),
])
def test_bad_config_names_the_cause(served, tiny_model_dir, tmp_path, capsys, override, message):
    cfg = write_config(tmp_path, served, tiny_model_dir)
    try:
        rc = run_train(cfg, override)
    except SystemExit as e:  # argparse: config errors found before anything starts
        rc = e.code
    assert rc in (1, 2)
    assert message in capsys.readouterr().err


def test_unreachable_server_is_an_error(tiny_model_dir, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert run_train(write_config(tmp_path, url, tiny_model_dir)) == 2  # found before loading (trainer.preflight)
    assert f"train.servers: {url} does not answer" in capsys.readouterr().err


def test_version_conflict_is_refused(served, tiny_model_dir, tmp_path):
    from trainer.cli import parse
    from trainer.infra.fleet import FleetError
    from trainer.run import build_run
    from weight_sync import push

    _, root, overrides = parse(["--config", str(write_config(tmp_path, served, tiny_model_dir))])
    run = build_run(root, None, overrides)
    try:
        params = dict(run.learner.engine.module.hf_named_tensors())
        push([served], params.items(), run.version + 5, transport="http", token=TOKEN)  # someone else moved on
        with pytest.raises(FleetError, match="version"):
            run.publisher.push()
        assert admin(served, "/weights/version")["version"] == run.version + 5
    finally:
        run.close()


def test_jsonl_prompts_with_math_reward(served, tiny_model_dir, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is {i}+{i}?", "ground_truth_answer": str(2 * i)})
                              for i in range(12)) + "\n")
    cfg = write_config(tmp_path, served, tiny_model_dir, num_steps=1, data=str(data), reward="math",
                       chat_template=True, eval_every=1, eval_size=4)
    assert run_train(cfg) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval_accuracy" in rows[0]
    assert rows[-1]["reward_mean"] == 0.0 and rows[-1]["frac_filtered_groups"] == 1.0
