"""Who may touch an open weight update, against a real server (uvicorn on loopback) and the project's sender.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_ownership.py

Run "run-a" pushes with weight_sync.WeightSender (http data plane) and is held inside its
data plane (its source blocks after the first tensor) while another caller acts:
- a commit, an abort or a bucket write naming another run is a 409 naming 'run-a', and
  changes nothing: run-a's push then completes and the server serves exactly its weights;
- a refused begin of run-a itself (stale version, bad manifest) leaves its open update as it
  was (no take-over before the checks), and the push completes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch

from weight_sync import WeightSender, WeightSyncError, weights_digest
from weight_sync.bucket import plan_buckets, specs_of
from weight_sync.control import ControlClient
from weight_sync.protocol import AbortRequest, BeginRequest, CommitRequest
from weight_sync.transports.http import put_bucket

TOKEN = "owner-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def srv(make_server):
    return make_server(max_batch=2, max_queue=8, max_model_len=128, admin_token=TOKEN, keep_versions=0)


def served(srv) -> dict:
    return httpx.get(srv.url + "/weights/checksum", headers=AUTH, timeout=30).json()


def status(srv) -> dict:
    return httpx.get(srv.url + "/weights/version", headers=AUTH, timeout=30).json()


class HeldPush:
    """run-a's push in a thread, stopped inside its data plane until `release()`."""

    def __init__(self, srv, run_id: str = "run-a"):
        self.version = status(srv)["version"] + 1
        self.named = {n: t.detach() + 0.01 * self.version for n, t in srv.engine.model.hf_named_tensors()}
        self.sender = WeightSender([srv.url], transport="http", token=TOKEN, run_id=run_id, bucket_bytes=1 << 14,
                                   timeout=60)
        self.inside, self._go, self.error = threading.Event(), threading.Event(), None
        self._calls = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def source(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._calls += 1
        for k, (n, t) in enumerate(self.named.items()):
            if self._calls == 2 and k == 1:  # the second call is the data plane, after begin
                self.inside.set()
                assert self._go.wait(60)
            yield n, t

    def _run(self) -> None:
        try:
            self.sender.push(self.source, self.version)
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.error = e

    def finish(self) -> None:
        self._go.set()
        self.thread.join(60)
        self.sender.close()
        if self.error is not None:
            raise self.error


@contextmanager
def held_push(srv) -> Iterator[HeldPush]:
    push = HeldPush(srv)
    push.thread.start()
    assert push.inside.wait(60), "the push never reached its data plane"
    try:
        yield push
    finally:
        push._go.set()
    push.finish()  # run-a's push completes: its update was not touched
    assert served(srv) == {"version": push.version, "digest": weights_digest(push.named)}


def detail(r: httpx.Response) -> str:
    return r.json()["error"]["message"]  # the app's error shape (server.api.errors)


def expect_409_naming_owner(call: Callable[[], object]) -> None:
    with pytest.raises(WeightSyncError) as e:
        call()
    assert getattr(e.value, "status", None) == 409 and "belongs to run 'run-a'" in str(e.value), e.value


def test_foreign_commit_is_409_and_changes_nothing(srv):
    before = served(srv)
    with held_push(srv) as push:
        other = ControlClient(srv.url, TOKEN, timeout=10)
        r = other.http.post(srv.url + "/weights/commit", json={"version": push.version, "run_id": "run-b"})
        assert r.status_code == 409 and "belongs to run 'run-a'" in detail(r)
        with pytest.raises(WeightSyncError, match="belongs to run 'run-a'"):
            other.commit(CommitRequest(version=push.version, run_id="run-b"))  # the sender's commit gives up at once
        other.close()
        assert served(srv) == before
        assert status(srv)["update"]["run_id"] == "run-a" and status(srv)["update"]["phase"] == "receiving"


def test_foreign_abort_is_409_and_changes_nothing(srv):
    with held_push(srv) as push:
        other = ControlClient(srv.url, TOKEN, timeout=10)
        for body in (AbortRequest(version=push.version, run_id="run-b"), AbortRequest(run_id="run-b"),
                     AbortRequest()):  # a named other run, any version, the anonymous run
            expect_409_naming_owner(lambda body=body: other.abort(body))
        other.close()
        assert status(srv)["update"]["run_id"] == "run-a"


def test_foreign_bucket_write_is_409_before_the_body_is_read(srv):
    with held_push(srv) as push:
        other = ControlClient(srv.url, TOKEN, timeout=10)
        zeros = torch.zeros(1 << 14, dtype=torch.uint8)
        for run_id in ("run-b", ""):
            r = put_bucket(other.http, srv.url, 0, zeros, 0, push.version, run_id=run_id)
            assert r.status_code == 409 and "belongs to run 'run-a'" in detail(r), r.text
        r = put_bucket(other.http, srv.url, 0, zeros, 0, push.version, run_id="bad id")
        assert r.status_code == 400 and "X-Weights-Run-Id" in detail(r)
        other.close()


def test_refused_begin_of_the_same_run_leaves_its_update_open(srv):
    if status(srv)["version"] == 0:  # a stale begin needs a served version >= 1
        first = HeldPush(srv)
        first.sender.push(first.named, first.version)
        first.sender.close()
    with held_push(srv) as push:
        own = push.sender.clients[0]
        specs = specs_of(list(push.named.items()))
        stale_version = status(srv)["version"]
        stale = plan_buckets(specs, 1 << 14, stale_version).to_dict()
        with pytest.raises(WeightSyncError) as e:
            own.begin(BeginRequest(version=stale_version, transport="http", manifest=stale, run_id="run-a"))
        assert e.value.status == 409 and "not greater than the current version" in str(e.value)
        good = plan_buckets(specs, 1 << 14, push.version + 1).to_dict()
        bad = {**good, "entries": good["entries"][1:]}
        with pytest.raises(WeightSyncError) as e:
            own.begin(BeginRequest(version=push.version + 1, transport="http", manifest=bad, run_id="run-a"))
        assert e.value.status == 400 and "missing 1 tensor" in str(e.value)
        now = status(srv)["update"]
        assert now["run_id"] == "run-a" and now["version"] == push.version and now["phase"] == "receiving"
        assert "superseded" not in status(srv)["last_failure"]
