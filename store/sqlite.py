"""SQLiteStore: the FeedbackStore on one SQLite file (WAL mode), shared by the processes of one host.

Several server processes and `dlrl align` open the same file at once: WAL lets readers run
beside the one writer, every write is one short `BEGIN IMMEDIATE` transaction (so a writer
waits for the lock instead of failing on an upgrade), and a busy timeout makes waiting
writers queue rather than error. `synchronous=NORMAL`: a committed write survives a crash or
restart of any process (a power cut may lose the last few commits).

Bounds: at most `max_records` records, kept exactly on every insert (a trigger-maintained
count, the oldest records go first, with their feedback); records older than `max_age_s`
are removed by `prune()`, run at open and then every `prune_every_s` seconds as writers add.
The version registry and the event log are small and never pruned.

    with open_store("runs/feedback.db", max_records=100_000, max_age_s=7 * 86400) as st:
        st.add_record(rec); st.add_feedback(rec.id, 1.0)
        batch = st.labeled(after_seq=cursor, min_version=v - 2)
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from store.sql import RECORD_COLS, SQLStore
from store.types import FeedbackStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id TEXT PRIMARY KEY, created REAL NOT NULL, server TEXT NOT NULL, version INTEGER NOT NULL,
    prompt TEXT, prompt_ids TEXT NOT NULL, completion_ids TEXT NOT NULL, text TEXT NOT NULL,
    finish_reason TEXT NOT NULL, trace TEXT NOT NULL, sampling TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS records_created ON records(created);
CREATE TABLE IF NOT EXISTS feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    record_id TEXT NOT NULL UNIQUE REFERENCES records(id) ON DELETE CASCADE,
    reward REAL NOT NULL, label TEXT, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY, parent INTEGER, step INTEGER NOT NULL, run_id TEXT NOT NULL,
    data TEXT NOT NULL, eval TEXT, status TEXT NOT NULL, status_order INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, kind TEXT NOT NULL,
    version INTEGER NOT NULL, replica TEXT, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counts (name TEXT PRIMARY KEY, n INTEGER NOT NULL);
INSERT OR IGNORE INTO counts VALUES ('records', (SELECT COUNT(*) FROM records));
CREATE TRIGGER IF NOT EXISTS records_ins AFTER INSERT ON records
    BEGIN UPDATE counts SET n = n + 1 WHERE name = 'records'; END;
CREATE TRIGGER IF NOT EXISTS records_del AFTER DELETE ON records
    BEGIN UPDATE counts SET n = n - 1 WHERE name = 'records'; END;
"""


_ROW = "(" + ",".join("?" * 11) + ")"
_INSERT_IF_FITS = (f"INSERT OR IGNORE INTO records ({RECORD_COLS}) SELECT * FROM (VALUES {{values}}) "
                   "WHERE (SELECT n FROM counts WHERE name = 'records') + ? <= ?")


class SQLiteStore(SQLStore):
    """FeedbackStore on an SQLite file; one connection per instance, shared by its threads."""

    MAX_ONE_STATEMENT = 256  # rows (x 11 values: under SQLite's 32766 host parameters)

    def __init__(self, path: str | os.PathLike, *, max_records: int = 100_000,
                 max_age_s: float = 7 * 86400.0, busy_timeout_s: float = 30.0,
                 prune_every_s: float = 60.0) -> None:
        if int(max_records) < 1:
            raise ValueError(f"max_records: must be >= 1, got {max_records}")
        if not float(max_age_s) > 0:
            raise ValueError(f"max_age_s: must be > 0, got {max_age_s}")
        self.path = Path(path)
        self.max_records = int(max_records)
        self.max_age_s = float(max_age_s)
        self.prune_every_s = float(prune_every_s)
        self._last_prune = 0.0
        self._lock = threading.Lock()
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE) and short.
        self._db = sqlite3.connect(str(self.path), timeout=busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        self._set_wal(busy_timeout_s)
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.execute("PRAGMA foreign_keys = ON")
        with self._lock:
            try:
                self._db.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
            except BaseException:
                self._rollback()
                raise
        self.prune()

    def _set_wal(self, timeout_s: float) -> None:
        """Switch to WAL (persistent in the file). The switch needs a moment alone with the
        file and may answer "locked" without waiting while another process opens it: retry."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
                continue
            if mode.lower() == "wal" or str(self.path) == ":memory:":
                return
            raise sqlite3.OperationalError(f"{self.path}: could not switch to WAL mode (got {mode})")

    # -- plumbing ---------------------------------------------------------------------------
    class _Txn:
        def __init__(self, store: SQLiteStore) -> None:
            self.store = store

        def __enter__(self) -> sqlite3.Connection:
            self.store._lock.acquire()
            try:
                self.store._db.execute("BEGIN IMMEDIATE")
            except BaseException:
                self.store._lock.release()
                raise
            return self.store._db

        def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
            db = self.store._db
            try:
                if exc_type is None:
                    try:
                        db.execute("COMMIT")
                    except BaseException:
                        self.store._rollback()
                        raise
                else:
                    self.store._rollback()
            finally:
                self.store._lock.release()

    def _rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already (it does so itself on a
        full disk, an I/O error or out of memory): the caller's exception, the real cause, is
        what propagates, never a "cannot rollback - no transaction is active" in its place."""
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # the connection is unusable; the caller's error says why

    def _write(self) -> SQLiteStore._Txn:
        return SQLiteStore._Txn(self)

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- records and feedback ---------------------------------------------------------------
    def _insert_if_fits(self, rows: list[tuple]) -> bool:
        """The common case as ONE autocommit statement (one sqlite3 call: the recorder's thread gives
        up and takes back the GIL once per batch, not once per statement and row, and under a busy
        server each of those hand-overs cost more than the insert): the rows go in only if the bound
        still holds with all of them. True when written; False when nothing was inserted (the batch
        would pass max_records, or every id was already there) and the bounded transaction decides.
        A write statement takes the write lock as it starts, so it waits (busy timeout) like BEGIN
        IMMEDIATE, and the counting trigger runs inside it."""
        sql = _INSERT_IF_FITS.format(values=",".join([_ROW] * len(rows)))
        with self._lock:
            n = self._db.execute(sql, [v for row in rows for v in row] + [len(rows), self.max_records]).rowcount
        return n > 0

    def _insert_bounded(self, rows: list[tuple]) -> None:
        """Insert in one transaction that also deletes the oldest records beyond max_records."""
        with self._write() as db:
            db.executemany(f"INSERT OR IGNORE INTO records ({RECORD_COLS}) VALUES {_ROW}", rows)
            excess = db.execute("SELECT n FROM counts WHERE name = 'records'").fetchone()[0] - self.max_records
            if excess > 0:
                db.execute("DELETE FROM records WHERE rowid IN "
                           "(SELECT rowid FROM records ORDER BY created, rowid LIMIT ?)", (excess,))

    # -- bounds and stats -------------------------------------------------------------------
    def prune(self) -> int:
        self._last_prune = time.monotonic()
        with self._write() as db:
            before = db.execute("SELECT n FROM counts WHERE name = 'records'").fetchone()[0]
            db.execute("DELETE FROM records WHERE created < ?", (time.time() - self.max_age_s,))
            excess = db.execute("SELECT n FROM counts WHERE name = 'records'").fetchone()[0] - self.max_records
            if excess > 0:
                db.execute("DELETE FROM records WHERE rowid IN "
                           "(SELECT rowid FROM records ORDER BY created, rowid LIMIT ?)", (excess,))
            return before - db.execute("SELECT n FROM counts WHERE name = 'records'").fetchone()[0]

    def stats(self) -> dict:
        num_records = self._read("SELECT n FROM counts WHERE name = 'records'")[0][0]
        oldest, newest = self._read("SELECT MIN(created), MAX(created) FROM records")[0]
        num_bytes = sum(os.path.getsize(p) for p in (self.path, Path(f"{self.path}-wal"))
                        if os.path.exists(p))
        return {"num_records": num_records,
                "num_feedback": self._read("SELECT COUNT(*) FROM feedback")[0][0],
                "num_versions": self._read("SELECT COUNT(*) FROM versions")[0][0],
                "num_events": self._read("SELECT COUNT(*) FROM events")[0][0],
                "bytes": num_bytes, "oldest": oldest, "newest": newest,
                "max_records": self.max_records, "max_age_s": self.max_age_s}


def open_store(path: str | os.PathLike, *, max_records: int = 100_000, max_age_s: float = 7 * 86400.0,
               **options: Any) -> FeedbackStore:
    """Open (creating or upgrading if needed) the feedback store at `path`: a
    `postgresql://` (or `postgres://`) URL opens store.postgres.PostgresStore (needs the
    `postgres` extra), anything else is the path of an SQLite file."""
    if str(path).startswith(("postgresql://", "postgres://")):
        try:
            from store.postgres import PostgresStore
        except ImportError as e:
            raise ImportError(f"a postgresql:// store needs psycopg 3 and psycopg_pool: pip install -e "
                              f"'.[postgres]' ({e})") from None
        return PostgresStore(str(path), max_records=max_records, max_age_s=max_age_s, **options)
    return SQLiteStore(path, max_records=max_records, max_age_s=max_age_s, **options)
