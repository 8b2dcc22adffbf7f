"""The rows both SQL stores (store/sqlite.py, store/postgres.py) write and read: the same columns,
lists and dicts as JSON text, and the same argument checks. Only the SQL around them differs.

    db.executemany(f"INSERT ... ({RECORD_COLS}) VALUES (...)", [record_row(r) for r in records])
    [record_of(row) for row in db.execute(f"SELECT {RECORD_COLS} FROM ...")]
"""

from __future__ import annotations

import json
import math

from store.types import VERSION_STATUSES, Labeled, Record

RECORD_COLS = ("id, created, server, version, prompt, prompt_ids, completion_ids, text, finish_reason, trace, "
               "sampling")
# a feedback row joined with its record (`feedback f JOIN records r`), as labeled_of reads it
LABELED_COLS = ", ".join(f"r.{c.strip()}" for c in RECORD_COLS.split(",")) + ", f.reward, f.label, f.time, f.seq"
VERSION_COLS = "version, parent, step, run_id, data, eval, status, created, updated"
EVENT_COLS = "id, time, kind, version, replica, detail"


def record_row(r: Record) -> tuple:
    return (r.id, float(r.created), r.server, int(r.version), r.prompt, json.dumps(list(r.prompt_ids)),
            json.dumps(list(r.completion_ids)), r.text, r.finish_reason, json.dumps(r.trace),
            json.dumps(r.sampling))


def record_of(row: tuple) -> Record:
    return Record(id=row[0], created=row[1], server=row[2], version=row[3], prompt=row[4],
                  prompt_ids=json.loads(row[5]), completion_ids=json.loads(row[6]), text=row[7],
                  finish_reason=row[8], trace=json.loads(row[9]), sampling=json.loads(row[10]))


def labeled_of(row: tuple) -> Labeled:
    return Labeled(record=record_of(row[:11]), reward=row[11], label=row[12], feedback_time=row[13], seq=row[14])


def version_row(version: int, parent: int | None, step: int, run_id: str, data: dict, now: float) -> tuple:
    """(version, parent, step, run_id, data, created, updated) of register_version."""
    return (int(version), None if parent is None else int(parent), int(step), str(run_id), json.dumps(data or {}),
            now, now)


def version_of(r: tuple) -> dict:
    return {"version": r[0], "parent": r[1], "step": r[2], "run_id": r[3], "data": json.loads(r[4]),
            "eval": None if r[5] is None else json.loads(r[5]), "status": r[6], "created": r[7], "updated": r[8]}


def event_of(r: tuple) -> dict:
    return {"id": r[0], "time": r[1], "kind": r[2], "version": r[3], "replica": r[4], "detail": json.loads(r[5])}


def finite_reward(reward: float) -> float:
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"reward: must be a finite number, got {reward}")
    return reward


def check_status(status: str | None) -> None:
    if status is not None and status not in VERSION_STATUSES:
        raise ValueError(f"status: must be one of {', '.join(VERSION_STATUSES)}, got {status!r}")
