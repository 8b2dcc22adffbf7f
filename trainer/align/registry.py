"""The version registry in the feedback store, as `dlrl align`, `dlrl versions` and the console use it.

    with open_store(cfg.store, **NO_PRUNE) as st:          # never prunes: the servers own the bounds
        rollback_replicas(cfg, token, st, version)          # registry first, then each serving replica

`rollback_replicas` is the manual rollback (`dlrl versions --rollback`, the console's button).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from trainer.align.replicas import ServingPool
from trainer.infra.fleet import FleetError

if TYPE_CHECKING:
    from store import FeedbackStore
    from trainer.align.config import AlignConfig


class _Bounds(TypedDict):
    max_records: int
    max_age_s: float


NO_PRUNE: _Bounds = {"max_records": 1 << 62, "max_age_s": 1e15}  # the servers own the store's bounds


def rollback_replicas(cfg: AlignConfig, token: str, st: FeedbackStore, version: int) -> dict:
    """The manual rollback (`dlrl versions --rollback`, the console's button): registry first, then
    each serving replica. ValueError when `version` never served. -> {version, previous, replicas}."""
    known = {v["version"]: v for v in st.versions()}
    status = known.get(version, {}).get("status")
    if status not in ("serving", "retired"):
        raise ValueError(f"version {version} never served (status {status or 'not registered'}); roll back "
                         "to a retired or serving version")
    current = st.serving_version()
    if current is not None and current != version:  # the registry first: a running controller adopts it
        st.update_version(current, status="rolled_back")  # and never "repairs" a rolled-back replica
        st.update_version(version, status="serving")
    pool = ServingPool(cfg.serving_replicas, token)
    results: dict[str, str] = {}
    try:
        for url in pool.urls:  # one at a time: capacity drops by one replica at most
            try:
                pool.rollback(url, version)
                results[url] = pool.checksum(url)
            except FleetError as e:
                results[url] = f"error: {e}"
    finally:
        pool.close()
    st.log_event("rollback", current if current is not None else version,
                 detail={"kind": "manual", "to": version, "replicas": results})
    return {"version": version, "previous": current, "replicas": results}
