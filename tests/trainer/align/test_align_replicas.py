"""The serving side of dlrl align against real `dlrl serve` replicas: a replica down during a promotion is
brought to the serving version when it returns; a canary rolled back automatically (users disliked it);
a manual rollback with `dlrl versions --rollback` restores the checksum on every replica and the
controller adopts it."""

from __future__ import annotations

import copy
import json
import time

import torch

from dllm.weights import load_pretrained
from store import open_store
from tests.conftest import start_server
from tests.helpers import admin_get
from trainer.align.bank import WeightBank
from trainer.align.cli import versions_main
from trainer.align.config import AlignConfig
from trainer.align.metrics import AlignMetrics
from trainer.align.promote import Candidate, FeedbackTally, Promoter
from trainer.align.replicas import ServingPool

TOKEN = "align-replicas-token"


def _weights(model, seed: int) -> dict:
    torch.manual_seed(seed)
    return {n: p.detach() + 0.01 * torch.randn_like(p) for n, p in model.hf_named_tensors()}


def _promote(promoter: Promoter, cand: Candidate, timeout: float = 60.0) -> None:
    assert promoter.start(cand)
    deadline = time.monotonic() + timeout
    while promoter.busy:
        assert time.monotonic() < deadline, "promotion did not finish"
        promoter.tick()
        time.sleep(0.2)


def test_missed_promotion_canary_rollback_and_manual_rollback(tiny_model_dir, tmp_path, capsys):
    model = load_pretrained(tiny_model_dir)
    a = start_server(tiny_model_dir, admin_token=TOKEN, keep_versions=3)  # real uvicorn servers on loopback
    b = start_server(tiny_model_dir, admin_token=TOKEN, keep_versions=3)
    store = open_store(tmp_path / "fb.db")
    cfg = AlignConfig(rollout_servers=["http://127.0.0.1:1"], serving_replicas=[a.url, b.url],
                      store=str(tmp_path / "fb.db"), canary_window_s=0.5, canary_min_requests=0,
                      reconcile_every_s=0.0, rollback_min_feedback=20, admin_token=TOKEN)
    pool = ServingPool(cfg.serving_replicas, TOKEN)
    bank = WeightBank(tmp_path / "promoted", copy.deepcopy(model), keep=3)
    tally = FeedbackTally()
    adopted: list[int] = []
    try:
        bank.put(0, dict(model.hf_named_tensors()))
        store.register_version(0, None, 0, "t", {})
        store.update_version(0, status="serving")
        promoter = Promoter(cfg, store, pool, bank, AlignMetrics(), tally, serving_version=0,
                            on_adopted=adopted.append)

        # 1. B is down during the promotion of version 5: the canary (A) and the roll-out go on without it
        b.stop()
        store.register_version(5, 0, 5, "t", {})
        busy_in_push, push = [], pool.push

        def watched_push(*args, **kwargs):  # the console's view while the canary push runs: in flight
            busy_in_push.append(promoter.busy)
            return push(*args, **kwargs)

        pool.push = watched_push
        _promote(promoter, Candidate(5, 5, _weights(model, 5), None))
        assert busy_in_push and all(busy_in_push)  # a rollback asked now is refused (409), not undone by the push
        assert store.serving_version() == 5 and admin_get(a.url, "/weights/version", TOKEN)["version"] == 5
        assert [e["replica"] for e in store.events() if e["kind"] == "replica_missed"] == [b.url]
        b = start_server(tiny_model_dir, port=b.config.port, admin_token=TOKEN, keep_versions=3)
        assert admin_get(b.url, "/weights/version", TOKEN)["version"] == 0  # it came back with its start weights
        promoter.reconcile()
        for url in (a.url, b.url):
            assert admin_get(url, "/weights/checksum", TOKEN)["digest"] == bank.digest(5)
        synced = [e for e in store.events() if e["kind"] == "replica_synced"]
        assert synced[-1]["replica"] == b.url and synced[-1]["detail"] == {"from": 0, "how": "push"}

        # 2. version 7 on the canary: users like its answers much less -> rolled back on A, B never sees it
        for i in range(40):
            tally.add(time.time() + 5, 5, float(i % 4 != 0))  # serving version: 0.75
            tally.add(time.time() + 5, 7, float(i % 4 == 0))  # candidate: 0.25
        store.register_version(7, 5, 7, "t", {})
        _promote(promoter, Candidate(7, 7, _weights(model, 7), None))
        assert store.versions()[-1]["status"] == "rolled_back" and store.serving_version() == 5
        rollback = [e for e in store.events() if e["kind"] == "rollback"][-1]
        assert rollback["version"] == 7 and rollback["detail"]["reasons"][0].startswith("feedback reward")
        for url in (a.url, b.url):
            assert admin_get(url, "/weights/version", TOKEN)["version"] == 5
            assert admin_get(url, "/weights/checksum", TOKEN)["digest"] == bank.digest(5)

        # 3. a manual rollback to version 0 (kept by both replicas), then the controller adopts it
        (tmp_path / "align.yaml").write_text(json.dumps({"align": {
            "serving_replicas": cfg.serving_replicas, "rollout_servers": cfg.rollout_servers,
            "store": cfg.store, "admin_token": TOKEN}}))
        assert versions_main(["--config", str(tmp_path / "align.yaml"), "--rollback", "0"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["previous"] == 5 and set(out["replicas"].values()) == {bank.digest(0)}
        for url in (a.url, b.url):
            assert admin_get(url, "/weights/checksum", TOKEN)["digest"] == bank.digest(0)
        assert store.serving_version() == 0
        promoter.reconcile()
        assert adopted == [0] and promoter.serving_version == 0
    finally:
        pool.close()
        store.close()
        for srv in (a, b):
            srv.stop()
