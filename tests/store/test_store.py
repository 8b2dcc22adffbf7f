"""The feedback store on both backends (one suite, `store_location`: an SQLite file and a real
PostgreSQL server): records, idempotent feedback, conflicts, bounds, registry, events, and
several real processes writing to one store at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from store import FeedbackConflict, Record, new_record_id, open_store

ROOT = Path(__file__).resolve().parents[2]


def _record(version: int = 1, created: float | None = None, rid: str | None = None) -> Record:
    return Record(id=rid or new_record_id(), created=time.time() if created is None else created,
                  server="tiny", version=version, prompt="1+2=", prompt_ids=[5, 6, 7],
                  completion_ids=[8, 9], text="3", finish_reason="stop",
                  trace={"prompt_len": 3, "block_size": 4, "steps": [1, 2], "logprobs": [-0.1, -0.2],
                         "version": version, "finish_reason": "stop", "tail_ids": [], "tail_steps": []},
                  sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0, "strategy": "dynamic"})


def test_records_round_trip_and_survive_reopen(store_location):
    path = store_location
    rec = _record()
    with open_store(path) as st:
        st.add_record(rec)
        st.add_record(rec)  # idempotent on id
        assert st.add_feedback(rec.id, 0.5, label="accept") is True
        assert st.stats()["num_records"] == 1
    with open_store(path) as st:
        assert st.get_record(rec.id) == rec
        (lab,) = st.labeled()
        assert (lab.record, lab.reward, lab.label, lab.seq) == (rec, 0.5, "accept", 1)
        assert st.prompts()[0] == rec
        assert st.get_record("rec-missing") is None


def test_feedback_duplicate_conflict_unknown(store_location):
    with open_store(store_location) as st:
        rec = _record()
        st.add_record(rec)
        assert st.add_feedback(rec.id, 1.0) is True
        assert st.add_feedback(rec.id, 1.0, label="accept") is False
        with pytest.raises(FeedbackConflict):
            st.add_feedback(rec.id, 0.0)
        with pytest.raises(ValueError):  # the spec's contract: a conflict is a ValueError
            st.add_feedback(rec.id, 0.0)
        with pytest.raises(KeyError):
            st.add_feedback("rec-unknown", 1.0)
        other = _record()
        st.add_record(other)
        with pytest.raises(ValueError, match="finite"):
            st.add_feedback(other.id, float("nan"))
        assert st.stats()["num_feedback"] == 1


def test_labeled_cursor_and_min_version(store_location):
    with open_store(store_location) as st:
        recs = [_record(version=v) for v in (1, 2, 3, 4)]
        for r in recs:
            st.add_record(r)
        for r in reversed(recs):  # feedback arrives in another order than the records
            st.add_feedback(r.id, float(r.version))
        assert [lab.record.version for lab in st.labeled()] == [4, 3, 2, 1]
        first = st.labeled(limit=2)
        assert [lab.reward for lab in st.labeled(after_seq=first[-1].seq)] == [2.0, 1.0]
        assert [lab.record.version for lab in st.labeled(min_version=3)] == [4, 3]


def test_bounds_by_count_and_age(store_location, tmp_path):
    with open_store(store_location, max_records=10, max_age_s=100.0) as st:
        now = time.time()
        old = [_record(created=now - 1000 + i) for i in range(3)]
        for r in old:
            st.add_record(r)
        st.add_feedback(old[0].id, 1.0)
        assert st.prune() == 3                   # too old
        assert st.stats()["num_records"] == 0 and st.stats()["num_feedback"] == 0
        for i in range(25):
            st.add_record(_record(created=now + i))
            assert st.stats()["num_records"] <= 10   # exact on every insert
        kept = st.prompts()
        assert [r.created for r in kept] == [now + i for i in range(15, 25)]  # the newest stay
    with pytest.raises(ValueError, match="max_records"):
        open_store(tmp_path / "x.db", max_records=0)


def test_version_registry_and_events(store_location):
    with open_store(store_location) as st:
        assert st.serving_version() is None
        st.register_version(1, None, 0, "run-a", {"on_policy": 0})
        st.register_version(2, 1, 5, "run-a", {"on_policy": 40, "feedback": 8})
        st.update_version(1, status="serving")
        st.update_version(2, eval={"accuracy": 0.7}, status="canary")
        assert st.serving_version() == 1
        st.update_version(2, status="serving")
        st.update_version(1, status="retired")
        assert st.serving_version() == 2
        st.update_version(2, status="rolled_back")
        st.update_version(1, status="serving")
        assert st.serving_version() == 1
        st.register_version(2, 1, 5, "run-a", {"on_policy": 41})   # re-register keeps status/eval
        v2 = st.versions()[1]
        assert (v2["status"], v2["eval"], v2["data"], v2["parent"]) == ("rolled_back", {"accuracy": 0.7},
                                                                         {"on_policy": 41}, 1)
        with pytest.raises(KeyError):
            st.update_version(9, status="serving")
        with pytest.raises(ValueError, match="status"):
            st.update_version(1, status="bogus")
        st.log_event("canary", 2, replica="http://r1", detail={"requests": 12})
        st.log_event("rollback", 1, replica="http://r1")
        evs = st.events()
        assert [(e["kind"], e["version"], e["replica"]) for e in evs] == [("canary", 2, "http://r1"),
                                                                            ("rollback", 1, "http://r1")]
        assert st.events(after_id=evs[0]["id"]) == evs[1:]
        assert evs[0]["detail"] == {"requests": 12}


_WRITER = """
import sys, time
sys.path.insert(0, {root!r})
from store import Record, open_store
path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
st = open_store(path, max_records=int(sys.argv[4]), prune_every_s=0.0)
for i in range(n):
    rid = f"{{name}}-{{i}}"
    st.add_record(Record(id=rid, created=time.time(), server=name, version=i, prompt=None,
                         prompt_ids=[1], completion_ids=[2], text="x", finish_reason="stop",
                         trace={{}}, sampling={{}}))
    try:
        st.add_feedback(rid, 1.0)
    except KeyError:  # another writer's insert already pushed it out (bounded store)
        assert st.max_records < 600
    st.log_event("replica_synced", i, replica=name)
print("ok", name)
"""


@pytest.mark.parametrize("max_records", [100_000, 50])
def test_several_processes_write_at_once(store_location, max_records):
    path = store_location
    script = _WRITER.format(root=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), f"p{k}", "150", str(max_records)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.startswith("ok")
    with open_store(path) as st:
        stats = st.stats()
        assert stats["num_events"] == 600
        if max_records >= 600:
            assert stats["num_records"] == 600 and stats["num_feedback"] == 600
            assert sorted(lab.seq for lab in st.labeled(limit=10_000)) == list(range(1, 601))
        else:
            assert stats["num_records"] <= max_records
    json.dumps(stats)  # stats are plain JSON
    if not path.endswith(".db"):
        return
    mode = subprocess.run([sys.executable, "-c", "import sqlite3,sys; print(sqlite3.connect(sys.argv[1])"
                           ".execute('PRAGMA journal_mode').fetchone()[0])", str(path)],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert mode == "wal"


def test_postgres_migrations_restart_and_registry_after_reopen(postgres):
    """PostgreSQL only: the schema version table, a newer schema refused, servers opening at
    once, a database restart under an open store, and the promotion a restarted controller reads."""
    import psycopg

    url = postgres.new_database("t_migrations")
    with ThreadPoolExecutor(4) as pool:  # four servers starting at once migrate once
        stores = list(pool.map(lambda _: open_store(url), range(4)))
    assert [s.schema_version() for s in stores] == [1] * 4
    for s in stores[1:]:
        s.close()
    st = stores[0]
    st.register_version(1, None, 0, "run", {})
    st.register_version(2, 1, 3, "run", {})
    st.update_version(1, status="serving")
    postgres.stop()           # the database restarts under an open store: the pool reconnects
    postgres.restart()
    rec = _record()
    for _ in range(50):
        try:
            st.add_record(rec)
            break
        except psycopg.OperationalError:
            time.sleep(0.1)
    st.update_version(2, status="serving")   # a promotion, then the controller "restarts"
    st.close()
    with open_store(url) as again:
        assert again.serving_version() == 2 and again.get_record(rec.id) == rec
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO dlrl_schema_version VALUES (99, 0)")
    with pytest.raises(RuntimeError, match="schema version 99 is newer"):
        open_store(url)
