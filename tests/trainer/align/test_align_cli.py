"""`dlrl align --check` and `dlrl versions`: configs that stop with the key named, the registry listed."""

from __future__ import annotations

import json
import time

import pytest

from dlrl.cli import main as dlrl
from store import open_store


def test_align_check_resolves_both_sections(capsys):
    assert dlrl(["align", "--config", "configs/align.yaml", "--check", "--json", "promote_every=5",
                 "train.lr=2e-4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["AlignConfig"]["promote_every"] == 5 and out["TrainConfig"]["lr"] == 2e-4
    assert out["TrainConfig"]["servers"] == out["AlignConfig"]["rollout_servers"]  # every push goes there


@pytest.mark.parametrize("override,named", [
    ("feedback_ratio=1.5", "align.feedback_ratio"),
    ("serving_replicas=[http://127.0.0.1:8100]", "align.serving_replicas"),
    ("train.is_correction=none", "train.is_correction"),
    ("bogus=1", "bogus"),
    ("on_gate_fail=maybe", "align.on_gate_fail"),
    ("train.zero_stage=2", "train.zero_stage"),
    ("promote_every=0", "align.promote_every"),
    ("canary_max_s=1", "align.canary_max_s"),
    ("train.mode=overlap", "train.mode"),
])
def test_align_bad_config_names_the_key(override, named, capsys):
    with pytest.raises(SystemExit) as e:
        dlrl(["align", "--config", "configs/align.yaml", "--check", override])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def _registry(path):
    with open_store(path) as st:
        st.register_version(0, None, 0, "run", {"initial": "m"})
        st.update_version(0, status="serving", eval={"accuracy": 0.31})
        st.register_version(3, 0, 3, "run", {"on_policy": 96, "feedback": 32})
        st.update_version(3, status="gated_out", eval={"accuracy": 0.2, "kl": 0.3})
        st.log_event("gate_failed", 3, detail={"reasons": ["held-out accuracy 0.2 < serving 0.31"]})


def test_versions_lists_the_registry_and_events(tmp_path, capsys):
    _registry(tmp_path / "fb.db")
    assert dlrl(["versions", "--store", str(tmp_path / "fb.db")]) == 0
    out = capsys.readouterr().out
    assert "gated_out" in out and "31.0%" in out and "serving version: 0" in out
    assert dlrl(["versions", f"store={tmp_path / 'fb.db'}"]) == 0  # --store is an alias of align.store
    assert capsys.readouterr().out == out
    assert dlrl(["versions", "--store", str(tmp_path / "fb.db"), "--events", "--json"]) == 0
    events = json.loads(capsys.readouterr().out)
    assert [e["kind"] for e in events] == ["gate_failed"] and events[0]["time"] <= time.time()


def test_versions_refuses_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        dlrl(["versions", "--store", str(tmp_path / "missing.db")])
    assert e.value.code == 2 and "align.store (--store): no feedback store" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        dlrl(["versions", "--store", str(tmp_path / "a.db"), f"align.store={tmp_path / 'b.db'}"])
    assert e.value.code == 2 and "align.store: given both as --store and as store=" in capsys.readouterr().err
    _registry(tmp_path / "fb.db")
    assert dlrl(["versions", "--store", str(tmp_path / "fb.db"), "--rollback", "3"]) == 2
    assert "never served" in capsys.readouterr().err


def test_users_and_launcher_refuse_bad_keys_before_starting(capsys):
    from dlrl_config import ConfigError
    from examples.align.local import LocalAlign
    from examples.align.users import main as users_main

    with pytest.raises(SystemExit) as e:
        users_main(["--config", "configs/align.yaml", "feedback_prob=1.5"])
    assert e.value.code == 2 and "users.feedback_prob" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"users\.num_users"):
        LocalAlign("configs/align.yaml", ["users.num_users=0"])
    with pytest.raises(ConfigError, match=r"align\.serving_replicas"):
        LocalAlign("configs/align.yaml", ["serving_replicas=[]"])
