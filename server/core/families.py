"""One /metrics from several processes: Prometheus families to and from the channel, merged.

    wire = to_wire(metrics.families(engine_part=True))      # the engine core's families (server.metrics)
    body = render(merge([own_api_families, core_wire, other_api_wire, ...]))   # GET /metrics of an API process

Each process keeps its own registry (server.metrics.ServerMetrics) and sends only the families it
updates: the engine core its engine and weight families (`ENGINE_FAMILIES`), every API process the
rest. The API process answering a scrape merges them: a family present in several API processes adds
up sample by sample (counters, histogram buckets, sums and counts, queue gauges), except the gauges
whose sum means nothing: `dlrl_store_up` (every process's store must be up: the minimum) and the
store's sizes (one store, read by each: the maximum); `_created` timestamps keep the earliest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from server.core.messages import Family

MIN_GAUGES = frozenset({"dlrl_store_up"})
MAX_GAUGES = frozenset({"dlrl_store_records", "dlrl_store_feedback", "dlrl_store_bytes", "dlrl_max_batch_size",
                        "dlrl_model_info"})


def to_wire(families: Iterable[Metric]) -> list[Family]:
    return [Family(f.name, f.type, f.documentation, [(s.name, dict(s.labels), float(s.value)) for s in f.samples])
            for f in families]


def _combine(family: str, kind: str, sample: str, old: float, new: float) -> float:
    if sample.endswith("_created"):
        return min(old, new)
    if kind == "gauge" and family in MIN_GAUGES:
        return min(old, new)
    if kind == "gauge" and family in MAX_GAUGES:
        return max(old, new)
    return old + new


def merge(sources: Iterable[Iterable[Family]]) -> list[Metric]:
    """The families of every source as one registry's, in first-seen order."""
    out: dict[str, tuple[Family, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for families in sources:
        for fam in families:
            head, values = out.setdefault(fam.name, (fam, {}))
            for name, labels, value in fam.samples:
                key = (name, tuple(sorted(labels.items())))
                values[key] = _combine(fam.name, head.type, name, values[key], value) if key in values else value
    merged = []
    for head, values in out.values():
        metric = Metric(head.name, head.documentation, head.type)
        metric.samples = [Sample(name, dict(labels), value) for (name, labels), value in values.items()]
        merged.append(metric)
    return merged


class _Collected:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def render(families: list[Metric]) -> bytes:
    """The text exposition format of merged families."""
    return generate_latest(_Collected(families))  # a prometheus_client Collector: an object with collect()


__all__ = ["merge", "render", "to_wire"]
