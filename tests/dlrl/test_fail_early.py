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
    assert rc == 0 and '"ok": true' in out


def test_serve_check_reports_a_busy_port_before_loading(busy_port, tmp_path, capsys):
    rc, _, err = _run(["serve", "--check", "--port", str(busy_port), f"server.model={tmp_path}/nope"], capsys)
    assert rc == 2
    assert f"server.port / --port: 127.0.0.1:{busy_port} is already in use" in err
    assert f"server.model / --model: '{tmp_path}/nope' does not exist" in err
    rc, _, err = _run(["serve", "--port", str(busy_port)], capsys)  # the real command: before training/loading
    assert rc == 2 and "already in use" in err


def test_a_rejected_admin_token_is_reported_before_loading(server, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train: {}\neval: {}\n")
    common = ["--config", str(tmp_path / "c.yaml"), f"servers=[{server.url}]", "start_server=false"]
    rc, _, err = _run(["train", *common, "admin_token=wrong", f"output_dir={tmp_path}/run", "--check"], capsys)
    assert rc == 2 and f"train.admin_token: {server.url} rejects the admin token (HTTP 40" in err
    rc, _, err = _run(["train", *common, f"output_dir={tmp_path}/run", "--check"], capsys)
    assert rc == 2 and "dlrl train needs its admin token" in err
    rc, out, err = _run(["train", *common, "admin_token=secret", f"output_dir={tmp_path}/run", "--check"], capsys)
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
    assert rc == 0 and '"ok": true' in out, err
    rc, _, err = _run([*common, f"server.port={port + 1}", "server.max_batch=0", "--check"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2, err
    assert f"server.port={port + 1}: the servers dlrl train starts listen where train.servers says" in lines[0]
    assert "the server it would start refuses its config: config key server.max_batch" in lines[1]
    cmd = serve_command(f"http://127.0.0.1:{port}", None, tiny_model_dir, [f"server.port={port}", "server.max_batch=2"])
    assert cmd[-1] == "server.max_batch=2" and not [c for c in cmd if c.startswith("server.port")]
    srv = LocalServer(f"http://127.0.0.1:{port}", None, tiny_model_dir, [f"server.port={port}"], "tok",
                      tmp_path / "server0.log")
    try:
        wait_until(lambda: is_ready(f"http://127.0.0.1:{port}") or srv.exited() is not None, 120, "the server")
        assert srv.exited() is None, (tmp_path / "server0.log").read_text()[-2000:]
    finally:
        srv.stop()
