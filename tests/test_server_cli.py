"""`dlrl serve` entry point (server.cli.main) as a real subprocess: config, overrides, logs, shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

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


def test_serve_subprocess(tiny_model_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "DLRL_ADMIN_TOKEN": "t0k"}
    cmd = [sys.executable, "-m", "server.cli", "--model", tiny_model_dir, "--port", str(port),
           "server.max_batch=2", "server.log_level=info"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=os.path.dirname(os.path.dirname(__file__)))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(url + "/generate", json={"prompt": "1+1=", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and len(r.json()["samples"][0]["completion_ids"]) <= 4
        assert httpx.get(url + "/admin/status", headers={"Authorization": "Bearer t0k"}).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    text = log.read_text()
    assert f"listening on http://127.0.0.1:{port}" in text and "serving model" in text
    assert tiny_model_dir in text
