"""Unit tests of WeightReceiver: validation, state machine, checksums, timeout; weights untouched on failure.

    .venv/bin/python -m pytest -q tests/weight_sync/test_weight_sync_receiver.py
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import ServedTensors
from tests.weight_sync.named_tensors import random_tensors
from weight_sync import NotOwner, UpdateConflict, UpdateFailed, WeightReceiver, weights_digest
from weight_sync.bucket import pack_stream, plan_buckets, specs_of
from weight_sync.checksum import checksum as crc32
from weight_sync.errors import ManifestError
from weight_sync.manifest import Manifest
from weight_sync.transports.shm import ShmRegion


def tensors(seed: int) -> dict[str, torch.Tensor]:
    return random_tensors({"w": ((40, 8), torch.float32), "b": ((8,), torch.bfloat16), "n": ((8,), torch.float32)}, seed)


def Served(lease_s: float = 30.0) -> ServedTensors:  # noqa: N802 - the served model of these tests
    return ServedTensors(tensors(0), lease_s=lease_s)


def packed(named: dict[str, torch.Tensor], version: int, bucket_bytes: int = 512) -> tuple[Manifest, list]:
    m = plan_buckets(specs_of(named.items()), bucket_bytes, version)
    bufs = [b.clone() for _, b, _ in pack_stream(m, iter(named.items()), lambda i, n: torch.empty(n, dtype=torch.uint8))]
    return m, bufs


def send_http(rx: WeightReceiver, version: int, bufs: list, with_header: bool = True) -> list[int]:
    crcs = [crc32(b) for b in bufs]
    for i, b in enumerate(bufs):
        rx.bucket_buffer(i, version).copy_(b)
        rx.bucket_written(i, b.numel(), crcs[i] if with_header else None, version)
    return crcs


@pytest.fixture
def served():
    s = Served()
    yield s
    s.rx.close()


def test_http_flow_applies_and_bumps_version(served):
    new = tensors(1)
    m, bufs = packed(new, 1)
    info = served.rx.begin(1, "http", m.to_json())
    assert info["num_buckets"] == len(bufs) > 1
    crcs = send_http(served.rx, 1, bufs, with_header=False)
    served.commit(1, crcs)
    assert served.version == 1 and served.digest() == weights_digest(new) == served.rx.digest()
    assert served.rx.status()["update"] is None


def test_shm_flow_in_process(served):
    new, region = tensors(2), ShmRegion()
    try:
        m = plan_buckets(specs_of(new.items()), 512, 4)
        opts = region.prepare(m)
        bufs = [b for _, b, _ in pack_stream(m, iter(new.items()), region.bucket)]
        served.rx.begin(4, "shm", m.to_dict(), opts)
        served.commit(4, [crc32(b) for b in bufs])
        assert served.version == 4 and served.digest() == weights_digest(new)
    finally:
        served.rx.close()
        region.close()


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t.update(extra=torch.zeros(2)), "unknown to the served model"),
        (lambda t: t.pop("n"), "missing 1 tensor"),
        (lambda t: t.update(w=torch.zeros(8, 40)), r"\(w\).shape"),
        (lambda t: t.update(b=torch.zeros(8)), r"\(b\).dtype: 'float32' but served is 'bfloat16'"),
    ],
)
def test_begin_rejects_mismatched_manifest(served, change, match):
    before = served.digest()
    bad = tensors(1)
    change(bad)
    m, _ = packed(bad, 1)
    with pytest.raises(ManifestError, match=match):
        served.rx.begin(1, "http", m.to_dict())
    assert served.rx.status()["update"] is None and served.digest() == before and served.version == 0


def test_begin_conflicts(served):
    m, _ = packed(tensors(1), 0)
    with pytest.raises(UpdateConflict, match="not greater than the current version 0"):
        served.rx.begin(0, "http", m)
    m, _ = packed(tensors(1), 2)
    with pytest.raises(ManifestError, match="manifest.version: 2 != request version 3"):
        served.rx.begin(3, "http", m)
    with pytest.raises(ManifestError, match="transport"):
        served.rx.begin(2, "carrier-pigeon", m)
    served.rx.begin(2, "http", m)
    m3, _ = packed(tensors(1), 3)
    with pytest.raises(UpdateConflict, match="already receiving"):
        served.rx.begin(3, "http", m3)


def test_commit_without_begin_and_wrong_version(served):
    with pytest.raises(UpdateConflict, match="no weight update in progress"):
        served.commit(1)
    m, bufs = packed(tensors(1), 1)
    served.rx.begin(1, "http", m)
    with pytest.raises(UpdateConflict, match="request says 2"):
        served.commit(2)


def test_truncated_and_corrupt_buckets_leave_weights_unchanged(served):
    before = served.digest()
    m, bufs = packed(tensors(1), 1)
    served.rx.begin(1, "http", m)
    rx = served.rx
    rx.bucket_buffer(0, 1)[:10].copy_(bufs[0][:10])
    with pytest.raises(UpdateFailed, match="truncated, got 10 of"):
        rx.bucket_written(0, 10, crc32(bufs[0]), 1)
    rx.bucket_buffer(0, 1).copy_(bufs[0])
    with pytest.raises(UpdateFailed, match="checksum mismatch"):
        rx.bucket_written(0, bufs[0].numel(), crc32(bufs[0]) ^ 1, 1)
    with pytest.raises(UpdateFailed, match="incomplete"):
        served.commit(1)
    assert rx.status()["update"] is None and served.digest() == before and served.version == 0 and not served.num_applied


def test_bad_commit_checksum_aborts(served):
    before = served.digest()
    m, bufs = packed(tensors(1), 1)
    served.rx.begin(1, "http", m)
    crcs = send_http(served.rx, 1, bufs, with_header=False)
    crcs[-1] ^= 0xFF
    with pytest.raises(UpdateFailed, match=f"checksum mismatch in bucket\\(s\\) \\[{len(bufs) - 1}\\]"):
        served.commit(1, crcs)
    assert served.rx.status()["update"] is None and served.digest() == before
    assert "checksum mismatch" in served.rx.status()["last_failure"]


def test_missing_checksum_is_an_error(served):
    m, bufs = packed(tensors(1), 1)
    served.rx.begin(1, "http", m)
    send_http(served.rx, 1, bufs, with_header=False)
    with pytest.raises(UpdateFailed, match="no checksum"):
        served.commit(1)


def test_apply_failure_keeps_version(served):
    m, bufs = packed(tensors(1), 1)
    served.rx.begin(1, "http", m)
    send_http(served.rx, 1, bufs)
    served.fail_apply = True
    with pytest.raises(UpdateFailed, match="apply failed: boom"):
        served.commit(1)
    assert served.version == 0 and served.rx.status()["update"] is None


def test_abort_states_and_queryable_outcome(served):
    assert served.rx.abort() is False
    m, bufs = packed(tensors(1), 1)
    served.rx.begin(1, "http", m, run_id="run-a")
    assert served.rx.abort(version=2) is False  # another version: nothing to abort
    with pytest.raises(NotOwner, match="belongs to run 'run-a', not to run 'run-b'"):
        served.rx.abort(version=1, run_id="run-b")  # another run's abort: refused, nothing changes
    assert served.rx.state(1)["state"] == "receiving"
    assert served.rx.abort(version=1, reason="test") is True
    assert "aborted: test" in served.rx.status()["last_failure"]
    assert served.rx.state(1)["state"] == "failed" and served.rx.state(1)["reason"] == "test"
    served.rx.begin(1, "http", m)  # same version may begin again after an abort
    send_http(served.rx, 1, bufs)
    served.rx.verify(1)
    assert served.rx.state(1)["state"] == "verified"
    assert served.rx.abort(version=1, reason="sender gave up") is True  # verified: not applied yet, abortable
    served.rx.begin(1, "http", m)
    send_http(served.rx, 1, bufs)
    served.rx.verify(1)
    entered, release = threading.Event(), threading.Event()
    copy = served.copy

    def slow_copy(named):
        entered.set()
        release.wait(10)
        copy(named)

    served.rx._apply_fn = slow_copy
    t = threading.Thread(target=served.apply, args=(1,))
    t.start()
    assert entered.wait(10)
    with pytest.raises(UpdateConflict, match="applying"):
        served.rx.abort()
    release.set()
    t.join(10)
    assert served.version == 1 and served.digest() == weights_digest(tensors(1))
    assert served.rx.state(1)["state"] == "applied" and served.rx.committed(1)
    served.commit(1)  # a retried commit of an applied version is a success (and a no-op)
    assert served.num_applied == 1


def test_stale_begin_times_out():
    s = Served(lease_s=0.3)
    before = s.digest()
    m, bufs = packed(tensors(1), 1)
    s.rx.begin(1, "http", m)
    s.rx.bucket_buffer(0, 1).copy_(bufs[0])
    s.rx.bucket_written(0, bufs[0].numel(), crc32(bufs[0]), 1)
    deadline = time.monotonic() + 5
    while s.rx.status()["update"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "lease expired" in s.rx.status()["last_failure"]
    with pytest.raises(UpdateConflict, match="no weight update in progress.*lease expired"):
        s.commit(1)
    assert s.digest() == before and s.version == 0
    s.rx.begin(1, "http", m)  # a new update can start
    send_http(s.rx, 1, bufs)
    s.commit(1)
    assert s.version == 1
    s.rx.close()


def test_shm_begin_with_unknown_region(served):
    m, _ = packed(tensors(1), 1)
    with pytest.raises(ManifestError, match="does not exist"):
        served.rx.begin(1, "shm", m, {"name": "dlrl_ws_no_such_region", "offsets": [0] * len(m.buckets)})
    with pytest.raises(ManifestError, match="shm transport needs"):
        served.rx.begin(1, "shm", m, {})


def test_staging_reused_across_updates_but_not_after_an_interrupted_write(served):
    rx = served.rx
    m1, bufs = packed(tensors(1), 1)
    rx.begin(1, "http", m1)
    first = rx.bucket_buffer(0, 1)
    rx.abort(reason="bucket 0 still streaming")  # an http body may still be writing into `first`
    rx.begin(1, "http", m1)
    second = rx.bucket_buffer(0, 1)
    assert second.data_ptr() != first.data_ptr()
    rx.bucket_written(0, None, None, 1)
    send_http(rx, 1, bufs)
    served.commit(1)
    m2, bufs2 = packed(tensors(2), 2)
    rx.begin(2, "http", m2)
    assert rx.bucket_buffer(0, 2).data_ptr() == second.data_ptr()  # same layout: no new allocation
    rx.bucket_written(0, None, None, 2)
    send_http(rx, 2, bufs2)
    served.commit(2)
    assert served.digest() == weights_digest(tensors(2))


def test_begin_refuses_buckets_larger_than_their_tensors(served):
    m, _ = packed(tensors(1), 1)
    d = m.to_dict()
    d["buckets"][-1]["nbytes"] += 1 << 40  # a terabyte of "padding" to stage
    d["total_bytes"] += 1 << 40
    with pytest.raises(ManifestError, match="beyond the tensors"):
        served.rx.begin(1, "http", d)
    assert served.rx.status()["update"] is None


def test_refused_begin_or_connect_of_the_same_run_changes_nothing(served):
    """A begin/connect of the run owning the open shm update that fails a check (stale version,
    bad manifest, missing region, bad dist options) leaves that update receiving; a valid one takes over."""
    new, region = tensors(2), ShmRegion("run-a")
    try:
        m = plan_buckets(specs_of(new.items()), 512, 1)
        opts = region.prepare(m)
        served.rx.begin(1, "shm", m.to_dict(), opts, run_id="run-a")
        bad, _ = packed({k: v for k, v in new.items() if k != "n"}, 2)
        gone = {**opts, "name": "dlrl_ws_no_such_region"}
        refusals = [
            (lambda: served.rx.begin(0, "shm", plan_buckets(specs_of(new.items()), 512, 0), opts, run_id="run-a"),
             "not greater than the current version 0"),
            (lambda: served.rx.begin(2, "shm", bad, opts, run_id="run-a"), "missing 1 tensor"),
            (lambda: served.rx.begin(2, "shm", plan_buckets(specs_of(new.items()), 512, 2), gone, run_id="run-a"),
             "does not exist"),
            (lambda: served.rx.begin(2, "dist", plan_buckets(specs_of(new.items()), 512, 2), {}, run_id="run-a"),
             "options.addr"),
            (lambda: served.rx.connect("shm", bad, opts, run_id="run-a"), "missing 1 tensor"),
            (lambda: served.rx.begin(2, "shm", plan_buckets(specs_of(new.items()), 512, 2), opts, run_id="run-b"),
             "by run 'run-a' is already receiving"),
        ]
        for call, match in refusals:
            with pytest.raises((ManifestError, UpdateConflict), match=match):
                call()
            assert served.rx.state(1)["state"] == "receiving" and served.rx.state(1)["run_id"] == "run-a"
        with pytest.raises(NotOwner, match="belongs to run 'run-a'"):
            served.commit(1, run_id="run-b")
        assert served.rx.status()["update"]["phase"] == "receiving"
        m2 = plan_buckets(specs_of(new.items()), 512, 2)
        bufs = [b for _, b, _ in pack_stream(m2, iter(new.items()), region.bucket)]
        assert served.rx.begin(2, "shm", m2.to_dict(), opts, run_id="run-a")["took_over"] == 1
        for i in range(len(bufs)):
            region.mark_ready(i, 2)
        served.commit(2, [crc32(b) for b in bufs], run_id="run-a")
        assert served.version == 2 and served.digest() == weights_digest(new)
        assert served.rx.state(1)["reason"] == "superseded by a new begin of run 'run-a'"
    finally:
        served.rx.close()
        region.close()


def test_a_reader_closed_under_a_polling_thread_never_unmaps_what_it_reads():
    """The staging thread polls ready stamps while an abort (another thread) closes the reader and
    the sender unlinks its region: the mapping lives until the last view dies, then it is gone."""
    from pathlib import Path

    from weight_sync.transports.shm import ShmReader

    region, reader = ShmRegion("run-poll"), ShmReader()
    name = region.prepare_header(4)
    stop, reads, errors = threading.Event(), [], []

    def poll() -> None:
        try:
            while not stop.is_set():
                reads.append(reader.ready(3) + reader.heartbeat())
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    try:
        for _ in range(20):  # each round: attach, poll, close under the poller, sender gone
            reader.header(name, 4)
            stamps = reader.stamps
            thread = threading.Thread(target=poll)
            thread.start()
            time.sleep(0.005)
            reader.close()
            assert stamps is not None and int(stamps[3]) == 0  # a view alive after close still reads its page
            stop.set()
            thread.join()
            stop.clear()
        assert reads and not errors
        region.close()
        del stamps
        maps = Path("/proc/self/maps").read_text()
        assert name.lstrip("/") not in maps  # the last view gone: nothing of the sender's region stays mapped
    finally:
        reader.close()
        region.close()
