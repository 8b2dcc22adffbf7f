"""The same typo help for every command (issue 47): an unknown config key, flag or command names the
nearest known one, for `dlrl serve` as for `dlrl train` and the rest; `server.*` keys given to `dlrl train`
are checked as `dlrl serve` checks them, never silently dropped.

    python -m pytest -q tests/dlrl/test_cli_typos.py
"""

from __future__ import annotations

import pytest

from dlrl.cli import main as dlrl


def _err(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = dlrl(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv,hint", [
    (["serve", "server.max_bach=32", "--check-config"], "unknown config key 'server.max_bach' (did you mean 'max_batch'?)"),
    (["serve", "max_bach=32", "--check-config"], "(did you mean 'max_batch'?)"),
    (["train", "num_step=3", "--check-config"], "(did you mean 'num_steps'?)"),
    (["train", "trian.lr=1", "--check-config"], "unknown section 'trian' (did you mean 'train'?)"),
    (["sft", "step=3", "--check-config"], "(did you mean 'steps'?)"),
    (["eval", "limt=3", "--check-config"], "(did you mean 'limit'?)"),
    (["generate", "max_token=3", "--check-config"], "(did you mean 'max_tokens'?)"),
    (["align", "promote_evry=3", "--check-config"], "(did you mean 'promote_every'?)"),
    (["versions", "stor=x", "--check-config"], "(did you mean 'store'?)"),
    (["serve", "--chek"], "unrecognized arguments: --chek (did you mean '--check'?)"),
    (["train", "--resme"], "(did you mean '--resume'?)"),
    (["eval", "--jsn", "--check-config"], "(did you mean '--json'?)"),
    (["serv", "--check"], "unknown command 'serv' (did you mean 'serve'?)"),
])
def test_typos_name_the_nearest(argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _err(argv, capsys)
    assert rc == 2 and hint in err, err


def test_train_checks_server_keys_even_when_it_starts_no_server(server, tiny_model_dir, tmp_path, capsys):
    """`dlrl train server.max_batch=...` configures servers it starts; against a running server it starts
    none, so the key is refused (and a typo named) instead of dropped."""
    (tmp_path / "c.yaml").write_text("train: {}\n")
    argv = ["train", "--config", str(tmp_path / "c.yaml"), f"servers=[{server.url}]", "start_server=false",
            f"model={tiny_model_dir}", "admin_token=secret", f"output_dir={tmp_path}/run", "--check"]
    rc, err = _err([*argv, "server.max_bach=3"], capsys)
    assert rc == 2 and "unknown config key 'server.max_bach' (did you mean 'max_batch'?)" in err, err
    rc, err = _err([*argv, "server.max_batch=3"], capsys)
    assert rc == 2 and "server.max_batch=3: server.* overrides configure the servers dlrl train starts, and it " \
        "starts none" in err, err
    rc, err = _err([*argv, "server.served_model_name=" + server.engine.model_name], capsys)  # read by train itself
    assert rc == 0, err
