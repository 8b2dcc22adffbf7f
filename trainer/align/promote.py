"""Promoter: how a candidate that passed the gate reaches the serving replicas, and how it is taken back.

    promoter = Promoter(align_cfg, store, pool, bank, metrics, tally, poll=..., on_promoted=..., on_rejected=...)
    promoter.start(Candidate(version=9, step=9, weights=..., gate=result, feedback_times=[...]))
    promoter.tick()          # between training steps: watch the canary, roll out, reconcile replicas
    promoter.finish(300)     # a bounded run's end: let the promotion in flight finish
    promoter.abort("SIGTERM")

Rolling update: the candidate goes to ONE replica first (the canary; a weight_sync push applies
between sequences, so requests wait a moment and never fail), which serves live traffic for
`align.canary_window_s` (and at least `canary_min_requests` requests, at most `canary_max_s`).
Its error rate, mean latency (from its `/metrics`) and user feedback reward (records of the
candidate version vs the serving version's, from the store) are compared with the other
replicas over the same window; worse by more than the `rollback_on_*` thresholds -> the canary
is rolled back (`POST /weights/rollback`: a version the server keeps in host memory). Otherwise
the remaining replicas get the candidate one at a time, so capacity never drops by more than
one replica. A replica that is down meanwhile is skipped and, like any replica found at another
version than it should serve (restarted, missed a rollback), is brought to it by `reconcile`
(a rollback when it keeps the version, else a push from the trainer's `WeightBank`).

The registry (the store) holds the state: statuses candidate -> canary -> serving (the previous
serving version -> retired) or rolled_back, and events promotion_started, canary, promoted,
rollback, promotion_aborted, replica_synced, replica_missed. A manual rollback
(`dlrl versions --rollback V`) changes the registry's serving version; the promoter adopts it.
`on_rejected` is called only for a candidate judged worse on the canary: a promotion aborted
(a stop, a manual rollback, a canary that went down, no replica up) says nothing about it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.align.replicas import LiveStats
from trainer.infra.fleet import FleetError

if TYPE_CHECKING:
    from store import FeedbackStore
    from trainer.align.bank import WeightBank
    from trainer.align.config import AlignConfig
    from trainer.align.metrics import AlignMetrics
    from trainer.align.replicas import ServingPool

log = logging.getLogger("dlrl.align")
SETTLE_S = 1.0  # after the canary push: requests that waited for it finish before the window opens


@dataclass
class Candidate:
    version: int
    step: int
    weights: dict
    gate: Any  # GateResult
    feedback_times: list[float] = field(default_factory=list)  # feedback it trained on, not serving yet


@dataclass
class Canary:
    cand: Candidate
    url: str
    pushed_at: float
    opened_at: float  # the window's start (monotonic), SETTLE_S after the push
    opened_wall: float  # the same, unix time (feedback times are unix times)
    base: dict[str, LiveStats] = field(default_factory=dict)  # each replica's counters at the start


class FeedbackTally:
    """(time, version, reward) of recent feedback, for the canary's live comparison."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self.items: deque[tuple[float, int, float]] = deque(maxlen=maxlen)

    def add(self, feedback_time: float, version: int, reward: float) -> None:
        self.items.append((feedback_time, version, reward))

    def rewards(self, version: int, since: float, min_count: int) -> list[float]:
        """Rewards of `version` given since `since`; too few -> its most recent ones, any time."""
        fresh = [r for t, v, r in self.items if v == version and t >= since]
        if len(fresh) >= min_count:
            return fresh
        return [r for _, v, r in self.items if v == version][-max(min_count, 50):]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _significantly_lower(c: list[float], o: list[float], drop: float, z: float) -> bool:
    """mean(c) < mean(o) - drop, and the difference is significant (one-sided Welch z-test):
    a canary is not rolled back on the noise of a few binary rewards."""
    mc, mo = _mean(c), _mean(o)
    if not mc < mo - drop:
        return False
    var = lambda xs, m: sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)  # noqa: E731
    se = math.sqrt(var(c, mc) / len(c) + var(o, mo) / len(o))
    return se == 0 or (mo - mc) / se > z


class Promoter:
    def __init__(self, cfg: AlignConfig, store: FeedbackStore, pool: ServingPool, bank: WeightBank, metrics: AlignMetrics,
                 tally: FeedbackTally, *, serving_version: int,
                 poll: Callable[[], None] = lambda: None,
                 on_promoted: Callable[[Candidate], None] = lambda c: None,
                 on_rejected: Callable[[Candidate, list[str]], None] = lambda c, r: None,
                 on_adopted: Callable[[int], None] = lambda v: None) -> None:
        self.cfg, self.store, self.pool, self.bank, self.metrics, self.tally = cfg, store, pool, bank, metrics, tally
        self.serving_version = serving_version
        self.poll, self.on_promoted, self.on_rejected, self.on_adopted = poll, on_promoted, on_rejected, on_adopted
        self.canary: Canary | None = None
        self.starting: int | None = None  # the version whose canary push is under way (start)
        self.last_reconcile = 0.0

    @property
    def busy(self) -> bool:
        """A promotion is in flight: its canary push under way (the console reads this from its own thread
        while the controller pushes), or its canary window open."""
        return self.canary is not None or self.starting is not None

    # ------------------------------------------------------------------ promotion
    def start(self, cand: Candidate) -> bool:
        """Push the candidate into the canary replica (the first one that is up); busy from the first byte."""
        self.starting = cand.version
        try:
            return self._start(cand)
        finally:
            self.starting = None

    def _start(self, cand: Candidate) -> bool:
        self.bank.put(cand.version, cand.weights)  # saved before any replica holds it
        self.store.update_version(cand.version, status="candidate")
        self.store.log_event("promotion_started", cand.version, detail={"serving": self.serving_version})
        for url in self.pool.urls:
            t0 = time.perf_counter()
            try:
                if self.pool.version(url) is None:
                    continue
                self.pool.push(url, cand.weights, cand.version)
            except FleetError as e:  # went down meanwhile: the next replica is the canary
                log.warning("version %d: canary push to %s failed: %s", cand.version, url, e)
                continue
            push_s = time.perf_counter() - t0
            time.sleep(SETTLE_S)  # requests that waited for the push finish before the window opens
            self.canary = c = Canary(cand, url, time.monotonic(), time.monotonic(), time.time())
            c.base = {u: st for u in self.pool.urls if (st := self.pool.live(u)) is not None}
            self.store.update_version(cand.version, status="canary")
            self.store.log_event("canary", cand.version, replica=url, detail={"push_s": push_s})
            self.metrics.candidate_version.set(cand.version)
            self.metrics.replica_target.labels(replica=url).set(cand.version)
            log.info("version %d: canary on %s for %.0fs", cand.version, url, self.cfg.canary_window_s)
            return True
        self._reject(cand, ["no serving replica took the canary push"], "rolled_back")
        return False

    def tick(self) -> None:
        try:
            if self.canary is not None:
                self._watch()
            if time.monotonic() - self.last_reconcile >= self.cfg.reconcile_every_s:
                self.reconcile()
        except FleetError as e:  # a replica answered with an error: tried again at the next tick
            log.warning("serving replicas: %s", e)

    def finish(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Wait (bounded) for the promotion in flight to finish, ticking; a stop signal aborts it."""
        deadline = time.monotonic() + timeout_s
        while self.canary is not None and time.monotonic() < deadline and not should_stop():
            self.tick()
            time.sleep(0.5)
        if self.canary is not None:
            self.abort("stopped by a signal" if should_stop() else
                       f"not finished within {timeout_s:.0f}s at the end of the run")

    def abort(self, reason: str) -> None:
        """Take the candidate back from the canary (the serving version stays)."""
        c = self.canary
        if c is None:
            return
        self.canary = None
        self.store.log_event("promotion_aborted", c.cand.version, replica=c.url, detail={"reason": reason})
        self._restore(c.url, self.serving_version)
        self._reject(c.cand, [reason], "rolled_back")

    def _watch(self) -> None:
        if self._adopt_registry():  # a manual rollback meanwhile ends the promotion
            return
        c = self.canary
        assert c is not None
        self.poll()
        version = self.pool.version(c.url)
        if version != c.cand.version:
            what = "went down" if version is None else f"serves version {version} now (a manual rollback?)"
            self.abort(f"the canary {c.url} {what} during the window")
            return
        stats = {u: (s - c.base[u]) for u in c.base if (s := self.pool.live(u)) is not None}
        elapsed = time.monotonic() - c.opened_at
        canary = stats.get(c.url, LiveStats())
        if elapsed < self.cfg.canary_window_s:
            return
        if canary.requests < self.cfg.canary_min_requests and elapsed < self.cfg.canary_max_s:
            return
        reasons, detail = self.judge(c, stats)
        if reasons:
            self._rollback_canary(c, reasons, detail)
        else:
            self._roll_out(c, detail)

    def judge(self, c: Canary, stats: dict[str, LiveStats]) -> tuple[list[str], dict]:
        """The canary against the other replicas over the window -> (reasons to roll back, numbers)."""
        cfg = self.cfg
        canary = stats.get(c.url, LiveStats())
        others = LiveStats()
        for u, s in stats.items():
            if u != c.url:
                others = others + s
        fb_c = self.tally.rewards(c.cand.version, c.opened_wall, cfg.rollback_min_feedback)
        fb_o = self.tally.rewards(self.serving_version, c.opened_wall, cfg.rollback_min_feedback)
        detail = {"canary_requests": canary.requests, "canary_error_rate": canary.error_rate,
                  "canary_latency_s": canary.mean_latency, "others_requests": others.requests,
                  "others_error_rate": others.error_rate, "others_latency_s": others.mean_latency,
                  "canary_feedback": len(fb_c), "canary_reward": _mean(fb_c), "others_feedback": len(fb_o),
                  "others_reward": _mean(fb_o)}
        reasons = []
        if canary.requests and canary.error_rate > others.error_rate + cfg.rollback_on_error_rate:
            reasons.append(f"error rate {canary.error_rate:.3f} > serving {others.error_rate:.3f} + "
                           f"{cfg.rollback_on_error_rate}")
        if canary.latency_count and others.latency_count and \
                canary.mean_latency > others.mean_latency * cfg.rollback_on_latency_ratio:
            reasons.append(f"mean latency {canary.mean_latency:.3f}s > serving {others.mean_latency:.3f}s x "
                           f"{cfg.rollback_on_latency_ratio}")
        if len(fb_c) >= cfg.rollback_min_feedback and len(fb_o) >= cfg.rollback_min_feedback and \
                _significantly_lower(fb_c, fb_o, cfg.rollback_on_reward_drop, cfg.rollback_z):
            reasons.append(f"feedback reward {_mean(fb_c):.3f} < serving {_mean(fb_o):.3f} - "
                           f"{cfg.rollback_on_reward_drop} ({len(fb_c)} vs {len(fb_o)} records, z > {cfg.rollback_z})")
        return reasons, detail

    def _roll_out(self, c: Canary, detail: dict) -> None:
        """The rest of the replicas, one at a time; then the candidate is the serving version."""
        v = c.cand.version
        for url in self.pool.urls:
            if url == c.url:
                continue
            self.metrics.replica_target.labels(replica=url).set(v)
            try:
                if self.pool.version(url) is None:
                    raise FleetError("down")
                self.pool.push(url, c.cand.weights, v)
            except FleetError as e:
                self.store.log_event("replica_missed", v, replica=url, detail={"reason": str(e)})
                log.warning("version %d: %s missed it (%s); it gets it when it is back", v, url, e)
        previous, self.serving_version = self.serving_version, v
        self.canary = None
        promoted_at = time.time()
        lat = sorted(promoted_at - t for t in c.cand.feedback_times)
        latency = {"num": len(lat), "min_s": lat[0], "median_s": lat[len(lat) // 2], "max_s": lat[-1]} if lat else {}
        for x in lat:
            self.metrics.feedback_to_serving.observe(x)
        self.store.update_version(v, status="serving")
        if previous != v:
            self.store.update_version(previous, status="retired")
        digest = self.bank.digest(v)
        self.store.log_event("promoted", v, detail={"previous": previous, "canary": c.url, **detail,
                                                    "feedback_to_serving": latency, "digest": digest})
        self.metrics.promotions.inc()
        self.metrics.serving_version.set(v)
        self.metrics.candidate_version.set(0)
        log.info("version %d promoted to every replica (was %d); feedback-to-serving %s", v, previous, latency)
        self.on_promoted(c.cand)

    def _rollback_canary(self, c: Canary, reasons: list[str], detail: dict) -> None:
        self.canary = None
        self._restore(c.url, self.serving_version)
        self.store.log_event("rollback", c.cand.version, replica=c.url,
                             detail={"kind": "auto", "to": self.serving_version, "reasons": reasons, **detail})
        self.metrics.rollbacks.labels(kind="auto").inc()
        log.warning("version %d rolled back on the canary %s: %s", c.cand.version, c.url, "; ".join(reasons))
        self._reject(c.cand, reasons, "rolled_back", judged=True)

    def _reject(self, cand: Candidate, reasons: list[str], status: str, judged: bool = False) -> None:
        self.store.update_version(cand.version, status=status)
        self.metrics.candidate_version.set(0)
        for url in self.pool.urls:
            self.metrics.replica_target.labels(replica=url).set(self.serving_version)
        if judged:
            self.on_rejected(cand, reasons)

    # ------------------------------------------------------------------ reconcile
    def _adopt_registry(self) -> bool:
        """The registry's serving version changed outside this controller (`dlrl versions --rollback`):
        it wins. A promotion in flight is aborted (its canary goes to the new serving version).
        Returns True when it changed."""
        registered = self.store.serving_version()
        if registered is None or registered == self.serving_version:
            return False
        log.warning("the registry's serving version is %d (was %d here): adopting it", registered,
                    self.serving_version)
        self.serving_version = registered
        self.metrics.serving_version.set(registered)
        c, self.canary = self.canary, None
        if c is not None:
            reason = f"the registry's serving version became {registered} (a manual rollback)"
            self.store.log_event("promotion_aborted", c.cand.version, replica=c.url, detail={"reason": reason})
            self._restore(c.url, registered)
            self._reject(c.cand, [reason], "rolled_back")
        self.on_adopted(registered)
        return True

    def reconcile(self) -> None:
        """Adopt a serving version changed in the registry (a manual rollback); bring every replica
        that is up to the version it should serve."""
        self.last_reconcile = time.monotonic()
        self._adopt_registry()
        for url in self.pool.urls:
            target = self.canary.cand.version if self.canary and url == self.canary.url else self.serving_version
            self.metrics.replica_target.labels(replica=url).set(target)
            try:
                version = self.pool.version(url)
            except FleetError as e:
                log.warning("replica %s: %s", url, e)
                continue
            self.metrics.replica_version.labels(replica=url).set(-1 if version is None else version)
            if version is None or version == target:
                continue
            try:
                how = self.pool.restore(url, target, self.bank.get)
            except FleetError as e:
                log.error("replica %s serves version %d, should serve %d: %s", url, version, target, e)
                continue
            self.metrics.replica_version.labels(replica=url).set(target)
            self.store.log_event("replica_synced", target, replica=url, detail={"from": version, "how": how})
            log.info("replica %s was at version %d: brought to %d (%s)", url, version, target, how)

    def _restore(self, url: str, version: int) -> None:
        try:
            self.pool.restore(url, version, self.bank.get)
        except FleetError as e:  # down: reconcile brings it back when it returns
            log.warning("could not bring %s back to version %d now: %s", url, version, e)
