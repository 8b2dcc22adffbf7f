"""Recording starts when a sample finishes: the API process hands the chosen samples to the writer the moment
the engine core's message says they ended (CoreClient.add_finish_listener, before their request hears of it),
so the commit runs while the request is still on its way back and
`record()` only waits for what is left. Aborted and failed samples are never written."""

from __future__ import annotations

import asyncio
import threading

import httpx

from dllm.sampling import SamplingParams
from dllm.trace import FinishReason
from server.api.state import server_state
from server.engine.sequence import ServerSequence as Sequence
from server.recording.recording import Recorder
from store.sqlite import SQLiteStore


def _seq(reason: FinishReason | None = FinishReason.STOP) -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4), block_size=4, mask_id=63)
    seq.completion_ids, seq.finish_reason, seq.text = [5, 6], reason, "ab"
    return seq


def _handed_over_by_the_engine(rec: Recorder, seqs: list[Sequence]) -> None:
    t = threading.Thread(target=rec._finished, args=(seqs,), name="dlrl-engine")  # as Engine._iterate calls it
    t.start()
    t.join()


def test_samples_are_written_as_they_finish_before_their_request_asks(tmp_path):
    store = SQLiteStore(tmp_path / "fb.db")
    rec = Recorder(store, mode="all", wait_s=5.0)
    try:
        seqs = [_seq(), _seq()]
        rec.expect(seqs, ["1+2="], n=2)
        _handed_over_by_the_engine(rec, seqs)
        rec.flush(timeout=10)
        assert store.stats()["num_records"] == 2  # written before anyone asked for the ids

        def refuse(records):  # the store is not touched again: the request only reads the outcome
            raise AssertionError("written twice")

        store.add_records = refuse
        ids = asyncio.run(rec.record([(s, "1+2=") for s in seqs]))
        assert all(ids) and len(set(ids)) == 2
        for rid in ids:
            got = store.get_record(rid)
            assert got is not None and got.prompt == "1+2=" and got.completion_ids == [5, 6]
    finally:
        rec.close()


def test_a_request_waits_only_for_what_is_not_written_yet(tmp_path):
    store = SQLiteStore(tmp_path / "fb.db")
    gate = threading.Event()
    real = store.add_records

    def slow(records):
        gate.wait(10)
        real(records)

    store.add_records = slow
    rec = Recorder(store, mode="all", wait_s=10.0)
    try:
        seqs = [_seq()]
        rec.expect(seqs, ["p"])
        _handed_over_by_the_engine(rec, seqs)

        async def ask() -> list[str | None]:
            task = asyncio.ensure_future(rec.record([(seqs[0], "p")]))
            await asyncio.sleep(0.2)
            assert not task.done()  # the commit is not done: the id is not handed out
            gate.set()
            return await task

        ids = asyncio.run(ask())
        assert ids[0] is not None and store.get_record(ids[0]) is not None
    finally:
        gate.set()
        rec.close()


def test_aborted_failed_and_unchosen_samples_are_never_written(tmp_path):
    store = SQLiteStore(tmp_path / "fb.db")
    rec = Recorder(store, mode="all")
    sampled = Recorder(SQLiteStore(tmp_path / "other.db"), mode="sample", fraction=0.0)
    try:
        seqs = [_seq(FinishReason.ABORT), _seq(FinishReason.ERROR), _seq(None)]
        rec.expect(seqs, ["p"], n=3)
        _handed_over_by_the_engine(rec, seqs)
        assert asyncio.run(rec.record([(s, "p") for s in seqs[:2]])) == [None, None]
        unchosen = [_seq()]
        sampled.expect(unchosen, ["p"])  # fraction 0: decided before the run, not again at the end
        _handed_over_by_the_engine(sampled, unchosen)
        assert asyncio.run(sampled.record([(unchosen[0], "p")])) == [None]
        rec.flush(timeout=10)
        sampled.flush(timeout=10)
        assert store.stats()["num_records"] == 0 and sampled.store.stats()["num_records"] == 0
    finally:
        rec.close()
        sampled.close()


def test_the_server_hands_finished_samples_over_as_the_engine_core_says_they_ended(make_server, tmp_path):
    srv = make_server(max_batch=4, max_model_len=64, record="all", store=str(tmp_path / "fb.db"))
    st = server_state(srv.app)
    recorder = st.recorder
    handed: list[tuple[str, int]] = []
    real = recorder._finished

    def spy(seqs):
        handed.extend((threading.current_thread().name, s.seq_id) for s in seqs)
        real(seqs)

    st.engine._finish_listeners[:] = [spy]  # the engine client calls the bound method it was given
    r = httpx.post(srv.url + "/generate", json={"prompt": "1+1=", "n": 3, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    ids = [s["record_id"] for s in r.json()["samples"]]
    # on the API process's event loop, as the core's message that they ended is read: before the request hears
    assert all(ids) and len(handed) == 3 and {name for name, _ in handed} == {srv.thread.name}
    assert all(recorder.store.get_record(rid) is not None for rid in ids)


def test_a_record_the_store_refuses_costs_only_its_own_request(store_location):
    """One sample the store cannot take (a lone surrogate anywhere; NUL in a PostgreSQL text column,
    which a prompt can carry and a byte-level tokenizer can generate) shares a batch with others: only
    it is dropped (counted as `refused`, its request gets no id, the store is not marked down); the
    rest are written and handed out."""
    from server.metrics import ServerMetrics
    from store import open_store

    pg = store_location.startswith("postgresql")
    store = open_store(store_location)
    metrics = ServerMetrics()
    rec = Recorder(store, mode="all", wait_s=10.0, metrics=metrics)
    try:
        poisons = ["bad \ud800 text"] + (["nul \x00 text"] if pg else [])
        seqs = [_seq() for _ in range(3 + len(poisons))]
        for seq, text in zip(seqs[1::2], poisons):
            seq.text = text
        prompts = [f"p{i}" for i in range(len(seqs))]
        for seq, prompt in zip(seqs, prompts):
            rec.expect([seq], [prompt])
        _handed_over_by_the_engine(rec, seqs)  # one step finished them all: one batch

        async def answer_each_request() -> list[str | None]:
            got = await asyncio.gather(*(rec.record([(seq, prompt)]) for seq, prompt in zip(seqs, prompts)))
            return [g[0] for g in got]

        ids = asyncio.run(answer_each_request())
        bad = [seq.text in poisons for seq in seqs]
        assert [rid is None for rid in ids] == bad
        for rid, prompt, b in zip(ids, prompts, bad):
            if not b:
                assert store.get_record(rid).prompt == prompt
        assert store.stats()["num_records"] == len(seqs) - len(poisons)
        assert metrics.records_dropped.labels(reason="refused")._value.get() == len(poisons)
        assert metrics.store_errors.labels(op="record", cause="refused")._value.get() >= len(poisons)
        assert metrics.store_up._value.get() == 1  # the store works: refusing a record is no outage
    finally:
        rec.close()
