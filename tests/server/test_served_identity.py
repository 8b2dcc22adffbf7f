"""What a server says it serves (issue 47): `/v1/models` reports the weight version it holds and the run
that pushed it; an export of `dlrl train` (runs/tiny-rl/final) is served under its run's name, not "final".

    python -m pytest -q tests/server/test_served_identity.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from dllm.hub import served_name
from tests.helpers import ADMIN_TOKEN
from weight_sync import WeightSender


def test_models_reports_the_version_and_the_run_that_pushed_it(make_server: Any) -> None:
    srv = make_server(admin_token=ADMIN_TOKEN, max_model_len=64)
    try:
        card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
        assert card["version"] == 0 and card["weights_run_id"] is None  # the weights it loaded
        named = {n: t.detach().clone() for n, t in srv.engine.model.hf_named_tensors()}
        sender = WeightSender([srv.url], transport="http", token=ADMIN_TOKEN, run_id="tiny-rl-1a2b3c4d", timeout=60)
        try:
            sender.push(named, 1)
        finally:
            sender.close()
        card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
        assert card["id"] == srv.engine.model_name and card["version"] == 1
        assert card["weights_run_id"] == "tiny-rl-1a2b3c4d"
    finally:
        srv.stop()


def test_an_export_is_served_under_its_runs_name(tmp_path: Path) -> None:
    final = tmp_path / "tiny-rl" / "final"
    final.mkdir(parents=True)
    assert served_name(str(final)) == "final"  # any folder: its name
    (final / "dlrl_version.json").write_text(json.dumps({"name": "tiny-rl", "run_id": "tiny-rl-1a2b", "version": 61}))
    assert served_name(str(final)) == "tiny-rl" and served_name(str(final), "mine") == "mine"
    (final / "dlrl_version.json").write_text(json.dumps({"name": "../../etc", "version": 61}))  # not a name
    assert served_name(str(final)) == "final"
