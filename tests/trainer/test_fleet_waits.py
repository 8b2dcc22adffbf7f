"""No silent wait for servers (issue 47): while the trainer waits for a server to become ready it logs which
one, for how long so far and at most, and the last line of the log of a server it started.

    python -m pytest -q tests/trainer/test_fleet_waits.py
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import free_port
from trainer.infra.fleet import FleetError, ServerFleet


@dataclass
class _Started:  # what the fleet reads of a LocalServer it started
    url: str
    log_path: Path

    def exited(self) -> int | None:
        return None


def test_waiting_for_a_server_says_what_it_waits_for(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: never ready
    (tmp_path / "server0.log").write_text("loading\nsft step 120/900 loss 0.7 | 2.0 steps/s | ~6 min left\n\n")
    fleet = ServerFleet([url], "token")
    fleet.local.append(_Started(url, tmp_path / "server0.log"))
    caplog.set_level(logging.INFO, logger="dlrl.train")
    try:
        with pytest.raises(FleetError, match="not ready after 2s"):
            fleet.wait_ready(2.0, log_every_s=0.5)
    finally:
        fleet.local.clear()
        fleet.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert len(lines) >= 2, lines
    assert f"waiting for {url} to be ready (" in lines[0] and "at most 2 s)" in lines[0]
    assert f"(log {tmp_path / 'server0.log'}): sft step 120/900" in lines[0]
