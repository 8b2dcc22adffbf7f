"""Fail early (issue 24): `--check`, and every command before it loads weights, reports a missing
data file, a reward that cannot be imported, a busy port (naming server.port) and a rejected
admin token; `--check-config` only parses."""

import socket

import pytest

from dlrl.cli import main as dlrl


def _run(argv, capsys):
    try:
        rc = dlrl(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def busy_port():
    """A port something (not a dlrl server) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_train_check_reports_file_import_and_busy_port_together(tmp_path, busy_port, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/tiny.yaml, no runs/ here
    argv = ["train", "--config", "none", f"data={tmp_path}/missing.jsonl", "reward=no_such_pkg.rewards:score",
            f"servers=[http://127.0.0.1:{busy_port}]"]
    (tmp_path / "none").write_text("train: {}\n")
    rc, _, err = _run([*argv, "--check"], capsys)
    assert rc == 2
    assert f"train.data: no such file '{tmp_path}/missing.jsonl'" in err
    assert "train.reward: cannot import 'no_such_pkg.rewards'" in err and "PYTHONPATH" in err
    assert f"127.0.0.1:{busy_port} is already in use" in err and "server.port" in err
    assert [line.split(":", 2)[1] for line in err.strip().splitlines()] == [" error"] * 3  # one problem per line
    rc, _, err = _run(argv, capsys)  # the real run stops the same way, before loading anything
    assert rc == 2 and "train.data" in err and not (tmp_path / "runs").exists()
    rc, out, _ = _run([*argv, "--check-config"], capsys)  # only the command line and the config
    assert rc == 0 and out.startswith("dlrl train --check-config: ok")


def test_serve_check_reports_a_busy_port_before_loading(busy_port, tmp_path, capsys):
    rc, _, err = _run(["serve", "--check", "--port", str(busy_port), f"server.model={tmp_path}/nope"], capsys)
    assert rc == 2
    assert f"server.port / --port: 127.0.0.1:{busy_port} is already in use" in err
    assert f"server.model / --model: '{tmp_path}/nope' does not exist" in err
    rc, _, err = _run(["serve", "--port", str(busy_port)], capsys)  # the real command: before training/loading
    assert rc == 2 and "already in use" in err


def test_a_rejected_admin_token_is_reported_before_loading(server, tmp_path, capsys, tiny_model_dir):
    (tmp_path / "c.yaml").write_text("train: {}\neval: {}\n")
    common = ["--config", str(tmp_path / "c.yaml"), f"servers=[{server.url}]", "start_server=false"]
    rc, _, err = _run(["train", *common, f"model={tiny_model_dir}", "admin_token=wrong", f"output_dir={tmp_path}/run", "--check"], capsys)
    assert rc == 2 and f"train.admin_token: {server.url} rejects the admin token (HTTP 40" in err
    rc, _, err = _run(["train", *common, f"output_dir={tmp_path}/run", "--check"], capsys)
    assert rc == 2 and "dlrl train needs its admin token" in err
    rc, out, err = _run(["train", *common, f"model={tiny_model_dir}", "admin_token=secret", f"output_dir={tmp_path}/run",
                         "--check"], capsys)
    assert rc == 0, err
    rc, _, err = _run(["eval", *common, f"model={tmp_path}", "admin_token=wrong", "--check"], capsys)
    assert rc == 2 and "eval.admin_token" in err


def test_train_check_catches_what_the_started_server_would_refuse(tmp_path, capsys, tiny_model_dir):
    """Issue 38 friction 1: `servers=[http://127.0.0.1:P] server.port=P` starts (the URL gives the port; the
    equal server.port is not forwarded twice); a different server.port, or a server key the server refuses,
    is reported by --check, not 5 minutes later in server0.log."""
    from tests.helpers import free_port, is_ready, wait_until
    from trainer.infra.local_servers import LocalServer, serve_command

    port = free_port()
    (tmp_path / "c.yaml").write_text("train: {}\n")
    common = ["train", "--config", str(tmp_path / "c.yaml"), f"servers=[http://127.0.0.1:{port}]",
              f"model={tiny_model_dir}", f"output_dir={tmp_path}/run"]
    rc, out, err = _run([*common, f"server.port={port}", "--check"], capsys)
    assert rc == 0 and out.startswith("dlrl train --check: ok"), err
    rc, _, err = _run([*common, f"server.port={port + 1}", "server.max_batch=0", "--check"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2, err
    assert f"server.port={port + 1}: the servers dlrl train starts listen where train.servers says" in lines[0]
    assert "the server it would start refuses its config: config key server.max_batch" in lines[1]
    cmd = serve_command(f"http://127.0.0.1:{port}", None, tiny_model_dir, [f"server.port={port}", "server.max_batch=2"])
    assert cmd[-1] == "server.max_batch=2" and not [c for c in cmd if c.startswith("server.port")]
    # the embedded default's sections go with it (the server trains / finds the folder the trainer uses)
    cmd = serve_command(f"http://127.0.0.1:{port}", None, "", ["sft.output_dir=/x", "model.hidden_size=64",
                                                               "task.seed=1", "num_steps=3", "train.lr=1"])
    assert cmd[-3:] == ["sft.output_dir=/x", "model.hidden_size=64", "task.seed=1"]
    srv = LocalServer(f"http://127.0.0.1:{port}", None, tiny_model_dir, [f"server.port={port}"], "tok",
                      tmp_path / "server0.log")
    try:
        wait_until(lambda: is_ready(f"http://127.0.0.1:{port}") or srv.exited() is not None, 120, "the server")
        assert srv.exited() is None, (tmp_path / "server0.log").read_text()[-2000:]
    finally:
        srv.stop()


# ------------------------------------------------------------- --check asks what the run asks (issue 47)

def test_check_refuses_a_server_that_serves_another_model(server, tmp_path, capsys):
    """The run refuses to overwrite the weights of a server of another model; --check says so first."""
    (tmp_path / "c.yaml").write_text("train: {}\n")
    common = ["train", "--config", str(tmp_path / "c.yaml"), f"servers=[{server.url}]", "start_server=false",
              "admin_token=secret", f"output_dir={tmp_path}/run", "server.served_model_name=other-model", "--check"]
    rc, _, err = _run(common, capsys)
    served = server.engine.model_name
    assert rc == 2 and f"train.servers: {server.url} serves {served!r}, not the model being trained ('other-model'" \
        in err and "take_over_servers=true" in err, err
    rc, out, err = _run([*common, "take_over_servers=true"], capsys)
    assert rc == 0, err
    assert f"serves {served!r} at weight version" in out and "will be taken over and renamed 'other-model'" in out
    evaluate = ["eval", "--config", str(tmp_path / "c.yaml"), f"servers=[{server.url}]", "start_server=false",
                f"model={tmp_path}", "verify=name", "--check"]  # eval.model's name: the folder's
    rc, _, err = _run(evaluate, capsys)
    assert rc == 2 and f"eval.servers: {server.url} serves {served!r}, not eval.model ({tmp_path.name!r}" in err, err
    assert "eval.own_server=true" in err


def test_check_refuses_the_family_choices_the_run_refuses(tmp_path, capsys, monkeypatch):
    """An objective registered for SDAR only (`register_objective(families=...)`), with the LLaDA default: the
    family comes from the config (no weights loaded). (The value model, once refused for LLaDA / Dream, is
    supported for every family now.)"""
    import dataclasses

    import trainer.rl.objectives  # noqa: F401  (registers the built-in objectives)
    from tests.helpers import free_port
    from trainer.objective_registry import OBJECTIVES

    monkeypatch.setitem(OBJECTIVES, "dipo", dataclasses.replace(OBJECTIVES["dipo"], families=("sdar",)))
    argv = ["train", "--config", "configs/tiny_llada.yaml", "objective=dipo", f"output_dir={tmp_path}/run",
            f"servers=[http://127.0.0.1:{free_port()}]", f"sft.output_dir={tmp_path}/sft", "--check"]
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and "train.objective: 'dipo' applies to sdar models, not to this llada model" in err, err
    monkeypatch.undo()
    rc, out, err = _run(argv[:3] + argv[4:], capsys)
    assert rc == 0, err
    assert f"the embedded default (llada) in {tmp_path}/sft, not trained yet" in out


def test_check_reports_the_resume_state(tmp_path, capsys):
    """--resume with nothing to continue is refused before anything starts, saying how to make a resumable
    run; a previous run without a checkpoint is never told to --resume; a complete run is told how to go on."""
    from tests.helpers import free_port

    out_dir = tmp_path / "run"
    argv = ["train", "--config", "configs/tiny.yaml", f"output_dir={out_dir}", f"servers=[http://127.0.0.1:{free_port()}]",
            f"sft.output_dir={tmp_path}/sft"]
    rc, _, err = _run([*argv, "--resume", "--check"], capsys)
    assert rc == 2 and f"--resume: nothing to continue in train.output_dir={out_dir}: it holds no run" in err, err
    assert "checkpoint_every=N makes a run resumable" in err
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text("{}\n")
    rc, _, err = _run([*argv, "--check"], capsys)
    assert rc == 2 and "holds a previous run (metrics.jsonl)" in err and "overwrite=true" in err, err
    assert "with --resume" not in err and "no checkpoint to --resume" in err
    step = out_dir / "checkpoint" / "step60"
    step.mkdir(parents=True)
    (out_dir / "checkpoint" / "latest").write_text("step60")
    (step / "client_state.json").write_text('{"step": 60, "version": 61, "world_size": 1, "zero_stage": 0}')
    rc, _, err = _run([*argv, "--check"], capsys)
    assert rc == 2 and "--resume num_steps=N" not in err and "is complete (checkpoint at step 60" in err, err
    rc, _, err = _run([*argv, "--resume", "--check"], capsys)
    assert rc == 2 and "raise num_steps to train it further (--resume num_steps=120)" in err, err
    rc, out, err = _run([*argv, "--resume", "num_steps=80", "--check"], capsys)
    assert rc == 0, err
    assert f"{out_dir}: --resume continues from its checkpoint at step 60 (weight version 61) to step 80" in out
    rc, _, err = _run([*argv, "--resume", "num_steps=80", "zero_stage=2", "--check"], capsys)
    assert rc == 2 and "written with ZeRO-0; this run uses train.zero_stage=2" in err


def test_check_prints_a_summary_and_json_on_request(tmp_path, capsys):
    import json

    from tests.helpers import free_port

    port = free_port()
    argv = ["train", "--config", "configs/tiny.yaml", f"output_dir={tmp_path}/run", f"servers=[http://127.0.0.1:{port}]",
            f"sft.output_dir={tmp_path}/sft", "--check"]
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == "dlrl train --check: ok" and len(lines) <= 10 and len(out) < 1000, out
    assert f"http://127.0.0.1:{port}  nothing answers: this command starts `dlrl serve` there" in out
    rc, out, err = _run([*argv, "--json"], capsys)
    body = json.loads(out)
    assert rc == 0 and body["ok"] is True and body["TrainConfig"]["output_dir"] == f"{tmp_path}/run"
    assert body["summary"]["output_dir"] == f"{tmp_path}/run: a fresh run"
