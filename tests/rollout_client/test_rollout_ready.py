"""rollout_client.ready: waiting on servers' /ready, bounded, stopping when a server's process is gone.

    .venv/bin/python -m pytest -q tests/rollout_client/test_rollout_ready.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout_client.ready import ServerExited, main, pid_exited, wait_ready
from tests.helpers import free_port


class _Ready(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def ready_url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_wait_ready_returns_once_every_server_answers(ready_url):
    wait_ready([ready_url, ready_url + "/"], timeout=5, exited=lambda url: False)
    assert main(["--timeout", "5", f"{ready_url}={os.getpid()}"]) == 0


def test_exited_process_stops_the_wait_at_once_naming_the_url(capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert pid_exited(dead.pid) and not pid_exited(os.getpid())
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ServerExited, match=url):
        wait_ready([url], timeout=60, exited=lambda u: dead.poll() is not None)
    assert main(["--name", "run.sh", "--timeout", "60", f"{url}={dead.pid}"]) == 1
    assert capsys.readouterr().err.strip() == f"run.sh: the server for {url} exited (see its log)"


def test_timeout_names_the_url_and_bad_arguments_name_the_item(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=url):
        wait_ready([url], timeout=0.3)
    with pytest.raises(SystemExit) as e:
        main(["http://127.0.0.1:1=notapid"])
    assert e.value.code == 2 and "'http://127.0.0.1:1=notapid' is not URL=PID" in capsys.readouterr().err
