"""`make align` (examples/align/local.py) prints the console's URL only once the console answers
(issue 38: it was printed ~40 s before), exactly once."""

from __future__ import annotations

import http.server
import threading
import time
from types import SimpleNamespace

from examples.align.local import LocalAlign
from tests.helpers import free_port


class _Running:
    def poll(self) -> None:
        return None


def test_console_url_is_printed_once_it_answers(tmp_path, capsys):
    port = free_port()
    stack = SimpleNamespace(cfg=SimpleNamespace(console_port=port, console_host="127.0.0.1",
                                                store=str(tmp_path / "none.db")),
                            console_url=f"http://127.0.0.1:{port}/", token_file=tmp_path / "admin_token")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    started: list[float] = []

    def serve_later() -> None:
        time.sleep(1.5)
        started.append(time.monotonic())
        server.serve_forever()

    threading.Thread(target=serve_later, daemon=True).start()
    try:
        assert LocalAlign.follow(stack, _Running(), duration=3.5, every_s=0.2) is False  # type: ignore[arg-type]
    finally:
        server.shutdown()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("console: ")]
    assert lines == [f"console: http://127.0.0.1:{port}/  (actions: the admin token in {tmp_path / 'admin_token'})"]
    assert started  # and the line came after the console answered (it polls before printing)
