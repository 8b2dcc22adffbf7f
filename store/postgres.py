"""PostgresStore: the FeedbackStore on a PostgreSQL database, shared by a fleet of servers and
`dlrl align` on any number of hosts (psycopg 3 with a connection pool; `pip install -e '.[postgres]'`).

    st = open_store("postgresql://dlrl:secret@db:5432/dlrl", max_records=1_000_000)

Schema: tables prefixed `dlrl_` (so the database can be shared), created and upgraded by
numbered migrations at open, under an advisory lock (several servers may start at once);
`dlrl_schema_version` records which ran. A database of a newer schema than this code is
refused with an error naming both versions.

Guarantees under concurrent writers (the ones `dlrl align` relies on):
- records and feedback are idempotent (`ON CONFLICT DO NOTHING`; a different reward for a
  record that has one raises FeedbackConflict);
- feedback `seq` and event ids follow commit order: they are taken under a transaction-
  scoped advisory lock, so a reader's cursor (`labeled(after_seq)`, `events(after_id)`)
  never skips a row that commits later with a smaller number;
- registry status changes are serialised by the same kind of lock: `status_order` is
  strictly increasing in commit order, so exactly one version is the serving version
  and a promotion committed before a controller restart is what the new controller reads;
- at most `max_records` records at every commit (a counter row, updated in the insert's
  transaction; the oldest records go first, their feedback with them).

Connections: a pool of `pool_size` (default 4) connections, each checked before use (so a
database restart costs the requests in flight, not the pool); an operation that cannot get
a connection within `connect_timeout_s` raises psycopg_pool.PoolTimeout ("unavailable").
Record batches (the server's recorder writes one per commit) take their own autocommit
connection instead: one prepared statement sent straight through libpq (the batch as one JSON
parameter), one round trip, and half the CPU of a pooled transaction on both ends
(benchmarks/RESULTS.md); only a batch that would pass `max_records` goes through a pooled
transaction that deletes the oldest. (A protocol-level prepared statement: behind PgBouncer in
transaction mode that needs PgBouncer >= 1.21 with `max_prepared_statements` set.)
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import orjson

from store.sql import RECORD_COLS, SQLStore

if TYPE_CHECKING:
    from psycopg import Connection, Cursor

SCHEMA_VERSION = 1
_MIGRATIONS = {
    1: """
CREATE TABLE dlrl_records (
    rseq BIGSERIAL UNIQUE, id TEXT PRIMARY KEY, created DOUBLE PRECISION NOT NULL, server TEXT NOT NULL,
    version INTEGER NOT NULL, prompt TEXT, prompt_ids TEXT NOT NULL, completion_ids TEXT NOT NULL,
    text TEXT NOT NULL, finish_reason TEXT NOT NULL, trace TEXT NOT NULL, sampling TEXT NOT NULL);
CREATE INDEX dlrl_records_created ON dlrl_records (created, rseq);
CREATE TABLE dlrl_feedback (
    seq BIGSERIAL PRIMARY KEY,
    record_id TEXT NOT NULL UNIQUE REFERENCES dlrl_records(id) ON DELETE CASCADE,
    reward DOUBLE PRECISION NOT NULL, label TEXT, time DOUBLE PRECISION NOT NULL);
CREATE TABLE dlrl_versions (
    version INTEGER PRIMARY KEY, parent INTEGER, step INTEGER NOT NULL, run_id TEXT NOT NULL,
    data TEXT NOT NULL, eval TEXT, status TEXT NOT NULL, status_order BIGINT NOT NULL DEFAULT 0,
    created DOUBLE PRECISION NOT NULL, updated DOUBLE PRECISION NOT NULL);
CREATE TABLE dlrl_events (
    id BIGSERIAL PRIMARY KEY, time DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL,
    version INTEGER NOT NULL, replica TEXT, detail TEXT NOT NULL);
CREATE TABLE dlrl_counts (name TEXT PRIMARY KEY, n BIGINT NOT NULL);
INSERT INTO dlrl_counts VALUES ('records', 0);
""",
}
# The bounded path (a batch that would pass max_records; see _bound): rows as typed VALUES.
_RECORD_TYPES = ("text", "float8", "text", "int4", "text", "text", "text", "text", "text", "text", "text")
_RECORD_VALUES = "(" + ",".join(f"%s::{t}" for t in _RECORD_TYPES) + ")"
_COLS = [c.strip() for c in RECORD_COLS.split(",")]
# One record batch in ONE autocommit statement, prepared once per connection and sent straight
# through libpq (psycopg.pq: one blocking call that releases the GIL, no per-parameter adaptation;
# the whole batch is one JSON parameter). The count row is locked first, the rows go in only if the
# bound still holds with all of them (else nothing is inserted, `fits` is false and the batch takes
# the transaction that deletes the oldest), and the counter moves by what was really inserted
# (ON CONFLICT rows are not counted). $1: JSON array of rows, $2: their number, $3: max_records.
_INSERT_IF_FITS_NAME = b"dlrl_insert_records_if_fits"
_INSERT_IF_FITS = (
    "WITH c AS (SELECT n FROM dlrl_counts WHERE name = 'records' FOR UPDATE), "
    f"ins AS (INSERT INTO dlrl_records ({RECORD_COLS}) SELECT {RECORD_COLS} FROM json_to_recordset($1::json) AS v("
    + ", ".join(f"{c} {t}" for c, t in zip(_COLS, _RECORD_TYPES)) + ") "
    "WHERE (SELECT n FROM c) + $2::int8 <= $3::int8 ON CONFLICT (id) DO NOTHING RETURNING 1) "
    "UPDATE dlrl_counts SET n = n + (SELECT COUNT(*) FROM ins) WHERE name = 'records' "
    "RETURNING (SELECT n FROM c) + $2::int8 <= $3::int8").encode()
# transaction-scoped advisory lock keys ("dlrl" + a number): migrations, feedback, registry+events
_LOCK_MIGRATE, _LOCK_FEEDBACK, _LOCK_REGISTRY = 0x646C726C00, 0x646C726C01, 0x646C726C02


def _check(conn: Connection, res: Any, ok: Any) -> Any:
    """A libpq result of `conn.pgconn`, or its error raised as the psycopg exception it maps to."""
    import psycopg

    if res.status != ok:
        raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
    return res


def _one_row(cur: Cursor[Any]) -> tuple:
    """The row of a query that always returns one (an aggregate, UPDATE ... RETURNING of a kept row)."""
    row = cur.fetchone()
    if row is None:
        raise RuntimeError("feedback store: a query that returns one row returned none")
    return row


class PostgresStore(SQLStore):
    """FeedbackStore on PostgreSQL; thread-safe (a connection pool), shared by processes and hosts."""

    PLACEHOLDER, TABLE_PREFIX, INSERT_ORDER, HOLD_RECORD = "%s", "dlrl_", "rseq", " FOR SHARE"
    MAX_ONE_STATEMENT = 1000

    def __init__(self, url: str, *, max_records: int = 100_000, max_age_s: float = 7 * 86400.0,
                 pool_size: int = 4, connect_timeout_s: float = 5.0, prune_every_s: float = 60.0) -> None:
        if int(max_records) < 1:
            raise ValueError(f"max_records: must be >= 1, got {max_records}")
        if not float(max_age_s) > 0:
            raise ValueError(f"max_age_s: must be > 0, got {max_age_s}")
        from psycopg_pool import ConnectionPool

        self.url, self.max_records, self.max_age_s = url, int(max_records), float(max_age_s)
        self.prune_every_s, self._last_prune = float(prune_every_s), 0.0
        self._connect_kwargs: dict[str, Any] = {"connect_timeout": max(1, int(connect_timeout_s))}  # libpq's, in whole seconds
        self._records_conn: Connection | None = None  # the record writer's own autocommit connection
        self._records_lock = threading.Lock()
        self._pool = ConnectionPool(url, min_size=1, max_size=int(pool_size), timeout=connect_timeout_s,
                                    check=ConnectionPool.check_connection, open=False, name="dlrl-store",
                                    # give up a failing reconnect chain soon: the pool's backoff doubles
                                    # (1, 2, 4, ... s), so after a 30 s outage it would sleep up to ~30 s
                                    # more; given up, the next request that needs a connection tries at once
                                    reconnect_timeout=max(2.0, float(connect_timeout_s)),
                                    reconnect_failed=lambda pool: None,  # StoreHealth logs the outage
                                    kwargs=self._connect_kwargs)
        self._pool.open(wait=True, timeout=connect_timeout_s)
        try:
            self._migrate()
            self.prune()
        except BaseException:
            self._pool.close()
            raise

    def _migrate(self) -> None:
        with self._pool.connection() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_MIGRATE,))
            conn.execute("CREATE TABLE IF NOT EXISTS dlrl_schema_version "
                         "(version INTEGER PRIMARY KEY, applied DOUBLE PRECISION NOT NULL)")
            current = _one_row(conn.execute("SELECT COALESCE(MAX(version), 0) FROM dlrl_schema_version"))[0]
            if current > SCHEMA_VERSION:
                raise RuntimeError(f"store schema version {current} is newer than this dlrl's ({SCHEMA_VERSION}): "
                                   "upgrade dlrl")
            for version in range(current + 1, SCHEMA_VERSION + 1):
                conn.execute(_MIGRATIONS[version])
                conn.execute("INSERT INTO dlrl_schema_version VALUES (%s, %s)", (version, time.time()))

    def schema_version(self) -> int:
        return self._one("SELECT MAX(version) FROM dlrl_schema_version")[0]

    def _one(self, sql: str, args: tuple = ()) -> tuple:
        with self._pool.connection() as conn:
            return _one_row(conn.execute(sql, args))

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._pool.connection() as conn:
            return conn.execute(sql, args).fetchall()

    def _write(self) -> Any:
        return self._pool.connection()  # one transaction: committed at the end of the block

    def _lock_feedback(self, conn: Any) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_FEEDBACK,))

    def _lock_registry(self, conn: Any) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_REGISTRY,))

    def close(self) -> None:
        with self._records_lock:
            if self._records_conn is not None:
                self._records_conn.close()
                self._records_conn = None
        self._pool.close()

    # -- records and feedback ---------------------------------------------------------------
    def _insert_bounded(self, rows: list[tuple]) -> None:
        with self._pool.connection() as conn:  # one transaction that also deletes the oldest
            for i in range(0, len(rows), 1000):  # one statement (a round trip) inserts and counts 1000 rows
                chunk = rows[i:i + 1000]
                values = ",".join([_RECORD_VALUES] * len(chunk))
                n = _one_row(conn.execute(f"WITH ins AS (INSERT INTO dlrl_records ({RECORD_COLS}) VALUES {values} "
                                          "ON CONFLICT (id) DO NOTHING RETURNING 1) UPDATE dlrl_counts SET n = n + "
                                          "(SELECT COUNT(*) FROM ins) WHERE name = 'records' RETURNING n",
                                          [v for row in chunk for v in row]))[0]
            if n > self.max_records:
                self._bound(conn, 0)

    def _insert_if_fits(self, rows: list[tuple]) -> bool:
        """The common case in one autocommit statement on the writer's own connection: True when
        written, False when the batch would pass max_records (nothing written). A connection broken
        by a database restart is replaced and the statement sent once more (idempotent: ids)."""
        import psycopg
        from psycopg import pq

        try:
            batch = orjson.dumps([dict(zip(_COLS, row)) for row in rows])
        except orjson.JSONEncodeError as e:  # a string that is not valid Unicode (a lone surrogate)
            raise psycopg.DataError(f"a record cannot be stored: {e}") from None
        args = [batch, str(len(rows)).encode(), str(self.max_records).encode()]
        with self._records_lock:
            for attempt in (0, 1):
                conn, fresh = self._records_conn, self._records_conn is None
                if conn is None:
                    conn = psycopg.connect(self.url, autocommit=True, **self._connect_kwargs)
                    try:
                        _check(conn, conn.pgconn.prepare(_INSERT_IF_FITS_NAME, _INSERT_IF_FITS), pq.ExecStatus.COMMAND_OK)
                    except BaseException:
                        conn.close()
                        raise
                    self._records_conn = conn
                try:
                    res = _check(conn, conn.pgconn.exec_prepared(_INSERT_IF_FITS_NAME, args), pq.ExecStatus.TUPLES_OK)
                    return res.get_value(0, 0) == b"t"
                except psycopg.Error:
                    if conn.pgconn.status == pq.ConnStatus.OK:
                        raise  # the statement failed, the connection is fine
                    conn.close()
                    self._records_conn = None
                    if fresh or attempt:
                        raise
        raise AssertionError("unreachable")

    def _bound(self, conn: Any, added: int) -> int:
        """Count `added` new records (the counter row serialises record writers) and delete the
        oldest beyond max_records; returns the number deleted."""
        n = conn.execute("UPDATE dlrl_counts SET n = n + %s WHERE name = 'records' RETURNING n", (added,)).fetchone()[0]
        if n <= self.max_records:
            return 0
        gone = conn.execute("DELETE FROM dlrl_records WHERE id IN (SELECT id FROM dlrl_records "
                            "ORDER BY created, rseq LIMIT %s)", (n - self.max_records,)).rowcount
        conn.execute("UPDATE dlrl_counts SET n = n - %s WHERE name = 'records'", (gone,))
        return gone

    # -- bounds and stats -------------------------------------------------------------------
    def prune(self) -> int:
        self._last_prune = time.monotonic()
        with self._pool.connection() as conn:
            conn.execute("SELECT n FROM dlrl_counts WHERE name = 'records' FOR UPDATE")
            gone = conn.execute("DELETE FROM dlrl_records WHERE created < %s",
                                (time.time() - self.max_age_s,)).rowcount
            conn.execute("UPDATE dlrl_counts SET n = n - %s WHERE name = 'records'", (gone,))
            return gone + self._bound(conn, 0)

    def stats(self) -> dict:
        with self._pool.connection() as conn:
            num_records = _one_row(conn.execute("SELECT n FROM dlrl_counts WHERE name = 'records'"))[0]
            oldest, newest = _one_row(conn.execute("SELECT MIN(created), MAX(created) FROM dlrl_records"))
            counts = [_one_row(conn.execute(f"SELECT COUNT(*) FROM dlrl_{t}"))[0]
                      for t in ("feedback", "versions", "events")]
            num_bytes = _one_row(conn.execute("SELECT SUM(pg_total_relation_size(c)) FROM unnest(ARRAY['dlrl_records', "
                                          "'dlrl_feedback', 'dlrl_versions', 'dlrl_events']::regclass[]) c"))[0]
        return {"num_records": num_records, "num_feedback": counts[0], "num_versions": counts[1],
                "num_events": counts[2], "bytes": int(num_bytes or 0), "oldest": oldest, "newest": newest,
                "max_records": self.max_records, "max_age_s": self.max_age_s}
