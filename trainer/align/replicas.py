"""ServingPool: the serving replicas as `dlrl align` sees them, through one `ServerFleet` client.

The serving replicas answer users and receive only promoted versions; the rollout servers the
trainer generates on are `run.fleet` (trainer.infra.fleet.ServerFleet), a disjoint set.

    pool = ServingPool(["http://127.0.0.1:8101", "http://127.0.0.1:8102"], token, sync_options)
    pool.version(url)            # int, or None while the replica is down
    pool.push(url, weights, 7)   # weight_sync push of a promoted version into ONE replica
    pool.rollback(url, 5)        # POST /weights/rollback: a version the replica keeps in host memory
    pool.kept(url)               # [versions it keeps]
    pool.live(url)               # LiveStats: requests, 5xx errors, latency sums (from GET /metrics)
    pool.generate(prompts, n, **sampling)   # generation on the replicas (the serving version's scores)

Every call names one replica and answers for it alone: a replica that is down never stops the
controller (it is brought back to the serving version when it returns). Pushes use the fleet's
weight_sync senders, one per replica, kept across promotions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from prometheus_client.parser import text_string_to_metric_families

from rollout_client.client import AdminError, Prompt, RolloutError
from rollout_client.protocol.rollout import Rollout
from trainer.infra.fleet import FleetError, ServerFleet

log = logging.getLogger("dlrl.align")


@dataclass
class LiveStats:
    """Counters of one replica's generation traffic since it started (or a difference of two)."""

    requests: float = 0.0
    errors: float = 0.0  # 5xx answers
    latency_sum: float = 0.0
    latency_count: float = 0.0

    def __sub__(self, other: LiveStats) -> LiveStats:
        return LiveStats(self.requests - other.requests, self.errors - other.errors,
                         self.latency_sum - other.latency_sum, self.latency_count - other.latency_count)

    def __add__(self, other: LiveStats) -> LiveStats:
        return LiveStats(self.requests + other.requests, self.errors + other.errors,
                         self.latency_sum + other.latency_sum, self.latency_count + other.latency_count)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests > 0 else 0.0

    @property
    def mean_latency(self) -> float:
        return self.latency_sum / self.latency_count if self.latency_count > 0 else 0.0


def parse_live(text: str) -> LiveStats:
    """The server's `dlrl_requests_total{status}` and `dlrl_request_latency_seconds` sums."""
    out = LiveStats()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "dlrl_requests_total":
                out.requests += s.value
                if str(s.labels.get("status", "")).startswith("5"):
                    out.errors += s.value
            elif s.name == "dlrl_request_latency_seconds_sum":
                out.latency_sum += s.value
            elif s.name == "dlrl_request_latency_seconds_count":
                out.latency_count += s.value
    return out


class ServingPool:
    def __init__(self, urls: list[str], token: str, sync_options: dict[str, Any] | None = None) -> None:
        self.fleet = ServerFleet(urls, token, sync_options=sync_options)
        self.urls = self.fleet.urls

    def close(self) -> None:
        self.fleet.close()

    def version(self, url: str) -> int | None:
        try:
            return int(self.fleet.admin(url, "GET", "/weights/version")["version"])
        except AdminError as e:
            if e.status is None:  # no answer: down (restarting, or gone)
                return None
            raise FleetError(str(e)) from e

    def versions(self) -> dict[str, int | None]:
        return {u: self.version(u) for u in self.urls}

    def checksum(self, url: str) -> str:
        return self.fleet.admin(url, "GET", "/weights/checksum")["digest"]

    def served_dtype(self, url: str) -> str | None:
        return self.fleet.admin(url, "GET", "/weights/version").get("dtype")

    def kept(self, url: str) -> list[int]:
        try:
            return [int(v) for v in self.fleet.admin(url, "GET", "/weights/kept").get("versions", [])]
        except AdminError as e:
            if e.status == 404:  # a server without rollback support keeps nothing
                return []
            raise FleetError(str(e)) from e

    def rollback(self, url: str, version: int) -> dict[str, Any]:
        try:
            return self.fleet.admin(url, "POST", "/weights/rollback", {"version": int(version)})
        except AdminError as e:
            raise FleetError(f"rollback of {url} to version {version} failed: {e}") from e

    def push(self, url: str, weights: dict, version: int) -> dict[str, Any]:
        """Push `weights` ({name: tensor}) as `version` into one replica (applied whole or not at all)."""
        return self.fleet.push(weights, version, [url])

    def restore(self, url: str, version: int, weights_of: Callable[[int], dict[str, torch.Tensor] | None]) -> str:
        """Bring one replica to `version`: a rollback when it keeps it (fast, no trainer data), else a
        push of `weights_of(version)`. Returns how ("rollback" or "push")."""
        if version in self.kept(url):
            self.rollback(url, version)
            return "rollback"
        weights = weights_of(version)
        if weights is None:
            raise FleetError(f"{url}: version {version} is neither kept by the replica nor saved by the trainer")
        self.push(url, weights, version)
        return "push"

    def live(self, url: str) -> LiveStats | None:
        try:
            return parse_live(self.fleet.metrics(url))
        except (RolloutError, ValueError):
            return None

    def generate(self, prompts: Sequence[Prompt], n: int, **sampling: Any) -> list[Rollout]:
        return self.fleet.generate(prompts, n, **sampling)
