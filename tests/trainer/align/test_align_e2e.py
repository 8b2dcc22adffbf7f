"""Continuous alignment end to end (issue 19 acceptance), all real processes on loopback: one rollout
server, two serving replicas recording into the store, simulated users sending requests and
exact-match feedback, and `dlrl align` (a candidate every 3 steps) whose steps 4-6 train on flipped
rewards (a deliberately bad candidate).

Checked: >= 2 promotions; feedback records trained on; the bad candidate stopped by the gate and never
served; a manual rollback (`dlrl versions --rollback`) while the controller runs restores the earlier
version's checksum on every replica and the controller adopts it (the next promotion replaces it); the
users see 0 errors throughout; the serving version's held-out accuracy ends >= 15 points above the
start; the controller's Prometheus metrics; SIGTERM checkpoints and exits 0.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import httpx
import pytest

from examples.align.local import LocalAlign
from store import open_store
from tests.helpers import admin_get, free_port, wait_until
from tests.trainer.align.flipping import FLIP_ENV
from trainer.align.cli import versions_main
from trainer.align.registry import NO_PRUNE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> str:
    """The embedded default's SFT starting point (~30% held-out accuracy): the committed checkpoint of
    tests/fixtures/tiny_sft.py (900 SFT steps of configs/align.yaml; checked against the config first),
    copied so that nothing the run writes lands in the repository."""
    from tests.fixtures.tiny_sft import FOLDER, check

    check()
    return str(shutil.copytree(FOLDER, tmp_path_factory.mktemp("sft") / "tiny-sft"))


def _config(tmp: Path) -> Path:
    import yaml

    cfg = yaml.safe_load(Path("configs/align.yaml").read_text())
    cfg["train"].update({"tensorboard": False, "device": "cpu"})  # a GPU box runs it on CPU too
    cfg["server"]["device"] = "cpu"
    cfg["align"]["console_port"] = 0  # the console has its own test (tests/trainer/align/test_align_console.py)
    cfg["users"].update({"num_users": 4, "think_time_s": 0.4, "feedback_delay_s": 0.5})
    path = tmp / "align.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _events(db: Path, kind: str) -> list[dict]:
    with open_store(db, **NO_PRUNE) as st:
        return [e for e in st.events() if e["kind"] == kind and not e["detail"].get("initial")]


def _manual_rollback(events: list[dict]) -> dict | None:
    return next((e for e in events if e["kind"] == "rollback" and e["detail"].get("kind") == "manual"), None)


def _after_rollback(db: Path) -> dict | None:
    """The first promotion after the manual rollback (None before it)."""
    with open_store(db, **NO_PRUNE) as st:
        events = st.events()
    rb = _manual_rollback(events)
    return None if rb is None else next((e for e in events if e["kind"] == "promoted" and e["id"] > rb["id"]
                                          and not e["detail"].get("initial")), None)


def test_align_end_to_end(sft_model, tmp_path, monkeypatch, capsys):
    db, metrics_port = tmp_path / "feedback.db", free_port()
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    overrides = [f"rollout_servers=[{urls[0]}]", f"serving_replicas=[{urls[1]},{urls[2]}]", f"store={db}",
                 f"output_dir={tmp_path / 'align'}", f"train.model={sft_model}", "max_steps=0", "promote_every=3",
                 "canary_window_s=3", "canary_min_requests=3",
                 "rollback_on_latency_ratio=5", f"metrics_port={metrics_port}", "reconcile_every_s=2"]
    # max_steps=0: the controller runs until SIGTERM, so the test, not the speed of the steps, decides
    # when the run ends (a fast box finished 15 steps before the manual rollback)
    # the tests' controller (tests/trainer/align/flipping.py) trains steps 4-6 on flipped rewards
    stack = LocalAlign(str(_config(tmp_path)), overrides, env={FLIP_ENV: "4,5,6"},
                       align_module="tests.trainer.align.flipping")
    monkeypatch.setenv("DLRL_ADMIN_TOKEN", stack.admin_token)  # what `dlrl versions --rollback` uses
    log = lambda: (stack.logs / "align.log").read_text()[-4000:]  # noqa: E731
    try:
        stack.start_servers()
        stack.start_users()
        align = stack.start_align()
        wait_until(lambda: len(_events(db, "promoted")) >= 2 or align.poll() is not None, 600, "two promotions")
        assert align.poll() is None, log()
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        total = [line for line in metrics.splitlines() if line.startswith("dlrl_align_promotions_total ")]
        assert total and float(total[0].split()[1]) >= 2 and "dlrl_align_replica_version{replica=" in metrics

        # a manual rollback to the first promoted version: its checksum on every replica; dlrl align adopts it
        promoted = _events(db, "promoted")
        first, digest = promoted[0]["version"], promoted[0]["detail"]["digest"]
        assert versions_main(["--config", stack.config, *overrides, "--rollback", str(first)]) == 0
        capsys.readouterr()
        for url in urls[1:]:
            assert admin_get(url, "/weights/checksum", stack.admin_token)["digest"] == digest
            assert admin_get(url, "/weights/version", stack.admin_token)["version"] == first

        # the next promotion is compared with (and replaces) the rolled-back version; then SIGTERM
        wait_until(lambda: _after_rollback(db) or align.poll() is not None, 600, "a promotion after the rollback")
        assert align.poll() is None, log()
        assert stack.stop("align", signal.SIGTERM, grace_s=300) == 0, log()
        assert "stopped by a signal" in log()
        assert stack.stop("users") == 0
        users = stack.users_stats()
    finally:
        stack.stop_all()
    with open_store(db, **NO_PRUNE) as st:
        versions, events, serving = {v["version"]: v for v in st.versions()}, st.events(), st.serving_version()
    before = [e for e in events if e["kind"] == "promoted" and not e["detail"].get("initial")
              and e["id"] < _manual_rollback(events)["id"]]
    nxt = _after_rollback(db)
    assert nxt["detail"]["previous"] == first, nxt
    assert versions[before[-1]["version"]]["status"] == "rolled_back"  # what served when the rollback came
    assert serving >= nxt["version"]

    assert users["requests"] > 100 and users["errors"] == 0, users["error_messages"]
    serving_ever = {e["version"] for e in events if e["kind"] in ("promoted", "canary")}
    assert set(users["versions_seen"]) <= serving_ever
    # the flipped candidate (the first one gated after steps 4-6: a canary in flight can delay it; its
    # `flipped` mark follows the lineage until a revert): stopped by the gate, never on a replica
    bad = [v for v, r in versions.items() if r["status"] == "gated_out"]
    assert any(versions[v]["data"].get("flipped") for v in bad), versions
    assert all(versions[v]["eval"]["gate_passed"] is False for v in bad)
    assert not serving_ever & set(bad) and not set(users["versions_seen"]) & set(bad)
    # feedback records were trained on; the manual rollback is in the registry
    assert sum(r["data"].get("feedback", 0) for r in versions.values()) > 0
    assert any(e["kind"] == "rollback" and e["detail"]["kind"] == "manual" for e in events)
    start, final = versions[min(versions)]["eval"]["accuracy"], versions[serving]["eval"]["accuracy"]
    assert final >= start + 0.15, (start, final)


def test_two_replicas_and_align_on_one_postgres_store(tiny_model_dir, tmp_path, postgres):
    """The fleet's shared store (issue 26), short: two replicas record into one PostgreSQL
    database, users give feedback through either, `dlrl align` registers the serving version
    there and reads the users' feedback from it while it trains; SIGTERM exits 0. (A random
    tiny model: nothing to promote; promotion on the store's registry is covered by
    tests/store/test_store.py on both backends and by the SQLite end-to-end run above.)"""
    store, metrics_port = postgres.new_database("align_e2e"), free_port()
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    overrides = [f"rollout_servers=[{urls[0]}]", f"serving_replicas=[{urls[1]},{urls[2]}]", f"store={store}",
                 f"output_dir={tmp_path / 'align'}", f"train.model={tiny_model_dir}", "max_steps=0",
                 f"metrics_port={metrics_port}", "prompt_source=task", "train.prompts_per_step=4",
                 "train.group_size=2", "reconcile_every_s=1"]
    stack = LocalAlign(str(_config(tmp_path)), overrides)
    log = lambda: (stack.logs / "align.log").read_text()[-4000:]  # noqa: E731

    def received() -> float:
        try:
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return 0.0
        return sum(float(line.split()[1]) for line in text.splitlines()
                   if line.startswith('dlrl_align_feedback_records_total{outcome="received"}'))

    try:
        stack.start_servers()
        stack.start_users()
        align = stack.start_align()
        wait_until(lambda: received() >= 20 or align.poll() is not None, 900, "feedback read from the store")
        assert align.poll() is None, log()
        assert stack.stop("align", signal.SIGTERM, grace_s=300) == 0, log()
        assert stack.stop("users") == 0
        users = stack.users_stats()
        with open_store(store, **NO_PRUNE) as st:
            serving, labeled = st.serving_version(), st.labeled(limit=100_000)
            servers = {r.server for r in st.prompts(limit=100_000)}
        for url in urls[1:]:
            assert admin_get(url, "/weights/version", stack.admin_token)["version"] == serving
    finally:
        stack.stop_all()
    assert serving == 0  # registered by the controller in the shared registry
    assert servers == set(urls[1:]) and len(labeled) >= 20  # both replicas recorded; users' feedback landed
    assert users["requests"] > 0 and users["errors"] == 0 and users["feedback_errors"] == 0, users
