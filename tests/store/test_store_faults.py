"""The feedback store's failures against real `dlrl serve` processes (issue 28 §3, §4):
a full disk under SQLite (a small tmpfs; without mount rights a file-size limit on the
server process) keeps its real cause in the log and a labelled metric, is logged
periodically while it lasts and once when it clears, serving goes on and the database is
not corrupted; a server SIGKILLed right after answering has every record_id it handed out
in the store, so feedback on each one succeeds after a restart on the same store; PostgreSQL
killed (`pg_ctl stop -m immediate`: no clean shutdown) and kept down for 30 s under a loaded
recording server (issues 26, 37) loses no acknowledged record and counts every record it could
not queue."""

from __future__ import annotations

import contextlib
import os
import re
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


def _unlabelled(line: str) -> str:
    """An exposition line without its model_name label (every server series has one)."""
    return re.sub(r'model_name="[^"]*",?', "", line).replace(",}", "}").replace("{}", "")


def _metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
               if _unlabelled(line).startswith(name))


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


class _Load:
    """Closed-loop clients sending /generate (n=2) until stopped: every answer with its time."""

    def __init__(self, url: str, clients: int = 2):
        import threading

        self.url, self.stop, self.answers = url, threading.Event(), []  # (t, status, [record_id, ...])
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                r = http.post(self.url + "/generate", json={"prompt": "1+2=", "n": 2, "max_tokens": 8})
                self.answers.append((time.monotonic(), r.status_code,
                                     [s["record_id"] for s in r.json()["samples"]] if r.status_code == 200 else []))

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


@pytest.mark.slow
def test_postgres_stopped_30s_under_load_nothing_acknowledged_lost(tiny_model_dir, tmp_path, monkeypatch, postgres):
    """PostgreSQL stopped for 30 s while clients keep generating: every request is answered
    (without ids while the store is down), records queue up to `record_max_pending` and the
    rest are dropped and counted, the queue is written when the database is back, and every
    record_id handed out is in the database: stored + dropped = every sample served."""
    import psycopg

    monkeypatch.setenv("DLRL_FEEDBACK_TOKEN", FEEDBACK)
    url = postgres.new_database("t_outage")
    bound = 40
    srv = start_server_process(tiny_model_dir, ADMIN, tmp_path, "server.record=all", f"server.store={url}",
                               "server.store_error_log_s=5", "server.max_batch=8", "server.record_wait_s=1",
                               f"server.record_max_pending={bound}")
    load = None
    try:
        before = _generate(srv.url)
        assert all(before)
        load = _Load(srv.url)
        time.sleep(1)
        postgres.stop("immediate")  # a crash: what a returned COMMIT wrote must survive (synchronous_commit=on)
        down, depths = time.monotonic(), []
        try:
            fb = _feedback(srv.url, before[0])
            assert fb.status_code == 503 and "unavailable" in fb.json()["error"]["message"]
            while time.monotonic() - down < 30:  # the queue never grows past its bound
                depths.append(_metric(srv.url, "dlrl_record_queue"))
                time.sleep(0.5)
            assert _metric(srv.url, "dlrl_store_up") == 0
            assert _metric(srv.url, 'dlrl_store_errors_total{cause="unavailable",op="record"}') >= 1
        finally:
            postgres.restart()
        up = time.monotonic()
        time.sleep(1)
        load.join()
        wait_until(lambda: _metric(srv.url, "dlrl_record_queue") == 0, 60, "queued records written")
        assert bound - 2 <= max(depths) <= bound  # filled up to the bound, never past it
        assert _metric(srv.url, "dlrl_store_up") == 1
        dropped = _metric(srv.url, 'dlrl_records_dropped_total{reason="queue_full"}')
        assert dropped == _metric(srv.url, "dlrl_records_dropped_total") > 0  # counted, and only for a full queue
        assert _feedback(srv.url, before[0]).status_code == 200
        assert "feedback store recovered" in srv.log_path.read_text()
    finally:
        if load is not None:
            load.join()
        srv.kill(signal.SIGTERM)
    statuses = [status for _, status, _ in load.answers]
    assert statuses and set(statuses) == {200}  # serving went on throughout
    outage = [ids for t, _, ids in load.answers if down + 2 < t < up]
    assert len(outage) >= 10 and all(i is None for ids in outage for i in ids)  # answered, no id that might not land
    acked = [i for _, _, ids in load.answers for i in ids if i] + before
    served = 2 * len(load.answers) + len(before)
    with psycopg.connect(url) as conn:
        stored = {row[0] for row in conn.execute("SELECT id FROM dlrl_records")}
    assert set(acked) <= stored  # no acknowledged record lost
    assert len(stored) + dropped == served  # and every other sample is either stored or counted as dropped


@pytest.mark.slow
def test_postgres_store_reconnects_at_once_after_an_outage(postgres):
    """After a 16 s outage both the pool (feedback, registry) and the record writer's own
    connection are back within seconds of the database, not after the pool's doubling backoff
    (attempts at 1, 3, 7, 15, 31 s would leave feedback unavailable until ~31 s), and a record
    batch sent again after a dropped connection is not counted twice."""
    from store import open_store
    from store.types import Record, error_cause, new_record_id

    def rec() -> Record:
        return Record(id=new_record_id(), created=time.time(), server="s", version=0, prompt="p",
                      prompt_ids=[1], completion_ids=[2], text="x", finish_reason="stop")

    st = open_store(postgres.new_database("t_reconnect"), max_records=1000, connect_timeout_s=1.0)
    try:
        first = rec()
        st.add_records([first])
        postgres.stop()
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 16:  # requests keep failing during the outage, each named
                for op in (lambda: st.add_feedback(first.id, 1.0), lambda: st.add_records([rec()])):
                    with pytest.raises(Exception) as err:
                        op()
                    assert error_cause(err.value) == "unavailable"
                time.sleep(0.5)
        finally:
            postgres.restart()
        back = time.monotonic()
        wait_until(lambda: _succeeds(lambda: st.add_feedback(first.id, 1.0)), 8, "feedback after the outage")
        wait_until(lambda: _succeeds(lambda: st.add_records([rec()])), 8, "records after the outage")
        assert time.monotonic() - back < 8
        assert st.stats()["num_records"] == 2 and st.stats()["num_feedback"] == 1
        st.add_records([first])  # an id written before is not inserted or counted again
        assert st.stats()["num_records"] == 2
    finally:
        st.close()


def _succeeds(op) -> bool:
    try:
        op()
    except Exception:
        return False
    return True
