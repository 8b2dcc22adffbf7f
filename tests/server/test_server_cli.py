"""`dlrl serve` entry point (server.cli.main) as a real subprocess: config, overrides, logs, shutdown."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.cli import build_parser
from server.config import load_server_config


def test_parser_and_overrides(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  max_batch: 3\n  port: 9001\n")
    args = build_parser().parse_args(["--config", str(cfg), "--port", "9002", "server.max_queue=5"])
    config = load_server_config(args.config, args.overrides)
    assert (config.max_batch, config.port, config.max_queue, config.host) == (3, 9001, 5, "127.0.0.1")
    with pytest.raises(ValueError, match="server.bogus"):
        load_server_config(str(cfg), ["server.bogus=1"])
    from server.cli import apply_aliases  # --host/--port/--model are aliases of server.host/port/model

    assert apply_aliases(config, args).port == 9002
    args = build_parser().parse_args(["--port", "x", "--model", "m"])
    with pytest.raises(ValueError, match="config key server.port: Input should be a valid integer"):
        apply_aliases(config, args)
    args = build_parser().parse_args(["--port", "9003", "server.port=9004"])
    with pytest.raises(ValueError, match="server.port: given both as --port and as server.port="):
        apply_aliases(load_server_config(None, args.overrides), args)
    args = build_parser().parse_args(["--host", "0.0.0.0", "--model", "m", "server.max_batch=2"])
    assert apply_aliases(config, args).model_dump(include={"host", "model"}) == {"host": "0.0.0.0", "model": "m"}


def test_serve_subprocess(serve_process, tiny_model_dir):
    srv = serve_process("server.max_batch=2", "server.log_level=info", env={"DLRL_ADMIN_TOKEN": "t0k"})
    r = httpx.post(srv.url + "/generate", json={"prompt": "1+1=", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and len(r.json()["samples"][0]["completion_ids"]) <= 4
    assert httpx.get(srv.url + "/admin/status", headers={"Authorization": "Bearer t0k"}).status_code == 200
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(timeout=30) == 0  # graceful: drains (nothing in flight) and exits 0
    text = srv.log()
    assert f"listening on {srv.url}" in text and "serving model" in text
    assert tiny_model_dir in text and "received SIGINT: shutting down gracefully" in text


def test_bad_override_names_the_key(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "server.cli", "--model", tiny_model_dir, "server.max_body_bytes=0"],
                         capture_output=True, text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert out.returncode == 2 and "server.max_body_bytes" in out.stderr
