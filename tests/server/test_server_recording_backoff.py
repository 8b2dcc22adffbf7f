"""The recorder's retries while the store fails: backed off (0.05 s doubling to 2 s) however many
requests arrive meanwhile, and everything queued is written once the store returns."""

from __future__ import annotations

import asyncio
import sqlite3
import time

from dllm.sampling import SamplingParams
from dllm.trace import FinishReason
from server.engine.sequence import ServerSequence as Sequence
from server.recording.recording import Recorder
from store.sqlite import SQLiteStore


class _FailingFor(SQLiteStore):
    """A real SQLite store whose writes fail with an I/O error until `until` (monotonic)."""

    def __init__(self, path, until: float):
        super().__init__(path)
        self.until, self.attempts = until, 0

    def add_records(self, records):
        self.attempts += 1
        if time.monotonic() < self.until:
            raise sqlite3.OperationalError("disk I/O error")
        super().add_records(records)


def _finished() -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4), block_size=4, mask_id=63)
    seq.completion_ids, seq.finish_reason = [5, 6], FinishReason.STOP
    return seq


def test_retries_are_backed_off_not_one_per_request(tmp_path):
    store = _FailingFor(tmp_path / "fb.db", until=time.monotonic() + 1.5)
    rec = Recorder(store, mode="all", wait_s=0.2)

    async def traffic() -> list[str | None]:
        ids: list[str | None] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.2:  # ~100 requests/s while the store fails
            ids += await rec.record([(_finished(), "p")])
            await asyncio.sleep(0.01)
        return ids

    try:
        ids = asyncio.run(traffic())
        failing = store.attempts
        assert ids and all(i is None for i in ids)  # nothing acknowledged while failing
        assert failing <= 8, f"{failing} write attempts in 1.2 s: retried per request, not backed off"
        rec.flush(timeout=10)
        assert store.stats()["num_records"] == len(ids)  # all queued records written once it returned
    finally:
        rec.close()
