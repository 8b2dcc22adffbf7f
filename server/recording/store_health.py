"""The feedback store's health as the server sees it: failures counted by cause, logged
with their real cause when they start, periodically while they last, and once when they clear.

    health = StoreHealth(metrics, log_every_s=30)
    try: store.add_records(batch); health.ok()
    except Exception as e: health.failed("record", e)      # -> cause "disk_full", "unavailable", ...

Metrics (server/metrics.py): `dlrl_store_errors_total{op,cause}` (op: record | feedback;
cause: store.ERROR_CAUSES or `queue_full`), `dlrl_store_up` (0 while failing). A storm of failures writes
one log line per `log_every_s` with a count, never one per failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from store import error_cause

if TYPE_CHECKING:
    from server.metrics import ServerMetrics

log = logging.getLogger("dlrl.server")


class StoreHealth:
    def __init__(self, metrics: ServerMetrics | None = None, *, log_every_s: float = 30.0):
        self.metrics = metrics
        self.log_every_s = float(log_every_s)
        self._lock = threading.Lock()
        self._since: float | None = None      # monotonic time the current failure began
        self._last_log = 0.0
        self._causes: Counter = Counter()     # failures of the current outage, by cause
        self._unlogged = 0
        self._refused = 0                      # refused items not logged yet
        self._refused_log: float | None = None  # when the last line about refused items was written
        if metrics is not None:
            metrics.store_up.set(1)

    @property
    def failing(self) -> bool:
        return self._since is not None

    def failed(self, op: str, exc: BaseException, cause: str | None = None) -> str:
        """Count and (rate-limited) log one failed store operation; returns its cause."""
        cause = cause or error_cause(exc)
        if self.metrics is not None:
            self.metrics.store_errors.labels(op=op, cause=cause).inc()
            self.metrics.store_up.set(0)
        now = time.monotonic()
        with self._lock:
            self._causes[cause] += 1
            if self._since is None:
                self._since, self._last_log, self._unlogged = now, now, 0
                log.error("feedback store failing (%s) on %s: %s: %s", cause, op, type(exc).__name__, exc)
            elif now - self._last_log >= self.log_every_s:
                log.error("feedback store still failing for %.0f s (%s): %d more failures since the last "
                          "report; last on %s: %s: %s", now - self._since, _causes(self._causes),
                          self._unlogged + 1, op, type(exc).__name__, exc)
                self._last_log, self._unlogged = now, 0
            else:
                self._unlogged += 1
        return cause

    def refused(self, op: str, exc: BaseException, n: int = 1) -> None:
        """Count and (rate-limited) log `n` items the store refused for what they hold (cause
        `refused`: NUL in PostgreSQL text, ...): the store works, so this is not an outage and
        `dlrl_store_up` stays as it is; a stream of them writes one line per `log_every_s`."""
        if self.metrics is not None:
            self.metrics.store_errors.labels(op=op, cause="refused").inc(n)
        now = time.monotonic()
        with self._lock:
            self._refused += n
            if self._refused_log is not None and now - self._refused_log < self.log_every_s:
                return
            self._refused_log, count, self._refused = now, self._refused, 0
        log.warning("feedback store refused %d %s item(s) for what they hold (dropped, counted); last: %s: %s",
                    count, op, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")

    def ok(self) -> None:
        """A store operation succeeded: an outage in progress is over (logged once)."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            log.warning("feedback store recovered after %.1f s (%s)", time.monotonic() - self._since,
                        _causes(self._causes))
            self._since = None
            self._causes.clear()
        if self.metrics is not None:
            self.metrics.store_up.set(1)


def _causes(counts: Counter) -> str:
    return ", ".join(f"{cause}: {n} failures" for cause, n in counts.most_common())
