"""The feedback store's failures against real `dlrl serve` processes (issue 28 §3, §4):
a full disk under SQLite (a small tmpfs; without mount rights a file-size limit on the
server process) keeps its real cause in the log and a labelled metric, is logged
periodically while it lasts and once when it clears, serving goes on and the database is
not corrupted; a server SIGKILLed right after answering has every record_id it handed out
in the store, so feedback on each one succeeds after a restart on the same store."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sqlite3
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import start_server_process, wait_until

ADMIN, FEEDBACK = "admin-tok", "feedback-tok"
FB = {"Authorization": f"Bearer {FEEDBACK}"}


def _metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
               if line.startswith(name))


def _generate(url: str, n: int = 4) -> list[str | None]:
    r = httpx.post(url + "/generate", json={"prompt": "1+2=", "n": n, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    return [s["record_id"] for s in r.json()["samples"]]


def _feedback(url: str, rid: str, reward: float = 1.0) -> httpx.Response:
    return httpx.post(url + "/v1/feedback", json={"id": rid, "reward": reward}, headers=FB, timeout=30)


class _FullDisk:
    """Makes the store's filesystem full and frees it again: a 4 MiB tmpfs filled with a
    filler file when mount is permitted, else a file-size limit (RLIMIT_FSIZE) on the server."""

    def __init__(self, root: Path):
        self.dir, self.mounted = root / "fs", False
        self.dir.mkdir()
        if os.environ.get("DLRL_TEST_FULL_DISK") != "rlimit" and os.geteuid() == 0:
            self.mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(self.dir)],
                                          capture_output=True).returncode == 0

    def fill(self, pid: int) -> None:
        if self.mounted:
            with contextlib.suppress(OSError), open(self.dir / "filler", "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * 4096)
        else:  # no file of the server may grow beyond the store's largest file
            limit = max(p.stat().st_size for p in self.dir.iterdir())
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    def free(self, pid: int) -> None:
        if self.mounted:
            (self.dir / "filler").unlink()
        else:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.dir)], check=False)


@pytest.fixture
def disk(tmp_path):
    disk = _FullDisk(tmp_path)
    yield disk
    disk.close()


@pytest.mark.slow
def test_full_disk_keeps_its_cause_serving_goes_on_and_clears(tiny_model_dir, tmp_path, monkeypatch, disk):
    monkeypatch.setenv("DLRL_FEEDBACK_TOKEN", FEEDBACK)
    store = disk.dir / "feedback.db"
    srv = start_server_process(tiny_model_dir, ADMIN, tmp_path, "server.record=all",
                               f"server.store={store}", "server.store_error_log_s=1", "server.max_batch=8")
    try:
        before = _generate(srv.url)
        assert all(before)
        disk.fill(srv.proc.pid)
        failed_ids = []
        for _ in range(40):  # until the WAL must grow (it may reuse the space it has)
            failed_ids = _generate(srv.url)
            if None in failed_ids:
                break
        assert failed_ids == [None] * 4, "the store never reported a full disk"
        for _ in range(4):  # serving goes on while the disk is full, for longer than the log interval
            assert _generate(srv.url) == [None] * 4
            time.sleep(0.4)
        cause = "disk_full" if disk.mounted else "io_error"  # a file-size limit: EFBIG, "disk I/O error"
        assert _metric(srv.url, f'dlrl_store_errors_total{{cause="{cause}",op="record"}}') >= 1
        assert _metric(srv.url, "dlrl_store_up") == 0
        assert _metric(srv.url, "dlrl_record_ids_withheld_total") >= 20
        fb = _feedback(srv.url, before[0])  # a written record; the feedback insert needs space too
        if fb.status_code == 503:
            assert cause in fb.json()["error"]["message"]
        log = srv.log_path.read_text()
        assert ("database or disk is full" if disk.mounted else "disk I/O error") in log
        assert "cannot rollback" not in log
        assert f"feedback store failing ({cause})" in log and "still failing" in log
        assert log.count("feedback store") < 20  # periodic lines with counts, not one per failure

        disk.free(srv.proc.pid)
        wait_until(lambda: "feedback store recovered" in srv.log_path.read_text(), 20, "recovery logged")
        wait_until(lambda: _metric(srv.url, "dlrl_record_queue") == 0, 20, "queued records written")
        assert _metric(srv.url, "dlrl_store_up") == 1
        assert _metric(srv.url, "dlrl_records_dropped_total") == 0  # queued through the outage, none lost
        after = _generate(srv.url)
        assert all(after) and _feedback(srv.url, after[0]).status_code == 200
        assert _feedback(srv.url, before[1]).status_code == 200
    finally:
        srv.kill(signal.SIGTERM)
        assert srv.proc.returncode == 0
    db = sqlite3.connect(store)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    ids = {r[0] for r in db.execute("SELECT id FROM records")}
    assert set(before) | set(after) <= ids and len(ids) >= 8 + 20
    db.close()


@pytest.mark.slow
def test_sigkill_right_after_answering_loses_no_handed_out_id(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DLRL_FEEDBACK_TOKEN", FEEDBACK)
    args = ("server.record=all", f"server.store={tmp_path / 'fb.db'}", "server.max_batch=16")
    srv = start_server_process(tiny_model_dir, ADMIN, tmp_path, *args)
    try:
        with ThreadPoolExecutor(8) as pool:  # concurrent requests: the writer batches their records
            ids = [i for batch in pool.map(lambda _: _generate(srv.url), range(16)) for i in batch]
    finally:
        srv.kill(signal.SIGKILL)  # right after the last answer: nothing flushed at shutdown
    assert srv.proc.returncode == -signal.SIGKILL
    assert len(ids) == 64 and all(ids) and len(set(ids)) == 64
    srv = start_server_process(tiny_model_dir, ADMIN, tmp_path, *args)  # the same store
    try:
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda rid: _feedback(srv.url, rid).status_code, ids))
        assert statuses == [200] * 64
    finally:
        srv.kill(signal.SIGTERM)


@pytest.mark.slow
def test_postgres_down_mid_run_serving_goes_on_and_queued_records_land(tiny_model_dir, tmp_path, monkeypatch,
                                                                       postgres):
    """PostgreSQL stopped under a recording server: requests keep answering (without ids),
    records stay queued and are written when the database is back; nothing is dropped."""
    import psycopg

    monkeypatch.setenv("DLRL_FEEDBACK_TOKEN", FEEDBACK)
    url = postgres.new_database("t_outage")
    srv = start_server_process(tiny_model_dir, ADMIN, tmp_path, "server.record=all", f"server.store={url}",
                               "server.store_error_log_s=1", "server.max_batch=8", "server.record_wait_s=1")
    try:
        before = _generate(srv.url)
        assert all(before)
        postgres.stop()
        try:
            during = [_generate(srv.url) for _ in range(3)]
            assert all(i is None for ids in during for i in ids)  # answered, no id that might not land
            fb = _feedback(srv.url, before[0])
            assert fb.status_code == 503 and "unavailable" in fb.json()["error"]["message"]
            assert _metric(srv.url, "dlrl_store_up") == 0 and _metric(srv.url, "dlrl_record_queue") >= 12
            assert _metric(srv.url, 'dlrl_store_errors_total{cause="unavailable",op="record"}') >= 1
        finally:
            postgres.restart()
        wait_until(lambda: _metric(srv.url, "dlrl_record_queue") == 0, 60, "queued records written")
        assert _metric(srv.url, "dlrl_store_up") == 1 and _metric(srv.url, "dlrl_records_dropped_total") == 0
        assert _feedback(srv.url, before[0]).status_code == 200
        assert "feedback store recovered" in srv.log_path.read_text()
    finally:
        srv.kill(signal.SIGTERM)
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT COUNT(*) FROM dlrl_records").fetchone()[0] == 16
