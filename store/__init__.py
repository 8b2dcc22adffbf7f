"""store: served samples, user feedback, the version registry and the event log (stdlib only).

The leaf package of continuous alignment (issue 19): the server records what it serves and
the feedback users give (`server.recording.recording`, `POST /v1/feedback`); `dlrl align` reads
labeled records as training data and keeps its version registry and events here. Imports
no sibling package. `open_store(path)` opens the default SQLite implementation (one host),
`open_store("postgresql://...")` the PostgreSQL one (a fleet; store/postgres.py, psycopg 3
imported only then); anything that implements `FeedbackStore` can replace them.

    from store import open_store, Record
    st = open_store("runs/feedback.db", max_records=100_000, max_age_s=7 * 86400)
"""

from store.sqlite import SQLiteStore, open_store
from store.types import (
    ERROR_CAUSES,
    VERSION_STATUSES,
    FeedbackConflict,
    FeedbackStore,
    Labeled,
    Record,
    error_cause,
    new_record_id,
)

__all__ = ["ERROR_CAUSES", "VERSION_STATUSES", "FeedbackConflict", "FeedbackStore", "Labeled", "Record", "SQLiteStore",
           "error_cause", "new_record_id", "open_store"]
