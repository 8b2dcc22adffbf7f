"""deploy/grafana and the metric names operators are told about (issue 25).

The provisioned dashboard is valid Grafana JSON (unique panel ids, the provisioned datasource's uid
on every panel and query, balanced PromQL), and every metric a query reads, and every `dlrl_*` name
README's "Operating dlrl" section mentions, is a family the processes export: a real server (over
HTTP, with a feedback store), the trainer's and the align controller's registries. The compose file
mounts these files where the provisioning expects them, and Prometheus scrapes the services that
serve /metrics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "dlrl.json"
NAME = re.compile(r"\bdlrl_[a-z0-9_]+")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


@pytest.fixture(scope="module")
def exported(make_server, tmp_path_factory) -> set[str]:
    """Every family name (and sample name) the three kinds of process export."""
    from trainer.align.metrics import AlignMetrics
    from trainer.monitor.train_metrics import TrainMetrics

    srv = make_server(record="all", store=str(tmp_path_factory.mktemp("store") / "fb.db"), max_model_len=128)
    texts = [httpx.get(srv.url + "/metrics", timeout=10).text, TrainMetrics().render().decode(),
             AlignMetrics().render().decode()]
    names = set()
    for text in texts:
        for fam in text_string_to_metric_families(text):
            names.add(fam.name)
            names.update(s.name for s in fam.samples)
    return names


def _family(name: str, exported: set[str]) -> bool:
    if name in exported:
        return True
    return any(name.endswith(sfx) and name[: -len(sfx)] in exported for sfx in SUFFIXES)


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_is_valid_grafana_json():
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"]
    [uid] = [d["uid"] for d in ds]
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == uid and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["datasource"]["uid"] == uid for t in p["targets"])
    for title, expr in _queries(dash):
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), (title, expr)
        assert expr.count("{") == expr.count("}"), (title, expr)
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("first token", "kv-cache", "weight version", "weight update", "promotions and rollbacks",
                  "feedback rates", "feedback to serving", "tokens per second", "step time"):
        assert topic in titles, topic


def test_every_query_reads_an_exported_metric(exported):
    for title, expr in _queries(_dashboard()):
        names = NAME.findall(expr)
        assert names, (title, expr)
        missing = [n for n in names if not _family(n, exported)]
        assert not missing, f"panel {title!r}: {missing} not exported"


def test_every_metric_the_readme_names_is_exported(exported):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Operating dlrl"):]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    names = set(NAME.findall(section))
    assert len(names) >= 30, sorted(names)
    missing = sorted(n for n in names if not _family(n, exported))
    assert not missing, missing


def test_compose_mounts_the_provisioning_and_prometheus_scrapes_the_services():
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "compose.yaml").read_text())
    configs = compose["configs"]
    mounts = {c["target"]: (ROOT / "deploy" / "compose" / configs[c["source"]]["file"]).resolve()
              for c in compose["services"]["grafana"]["configs"]}
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dlrl.yaml").read_text())["providers"][0]
    assert mounts[provider["options"]["path"] + "/dlrl.json"] == DASHBOARD
    assert mounts["/etc/grafana/provisioning/datasources/prometheus.yaml"] == \
        GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
    prom = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    cfg = yaml.safe_load((ROOT / "deploy" / "compose" / "config.yaml").read_text())
    assert f"trainer:{cfg['train']['metrics_port']}" in targets and cfg["train"]["metrics_host"] == "0.0.0.0"
    for name in ("server-0", "server-1"):
        port = compose["services"][name]["command"][compose["services"][name]["command"].index("--port") + 1]
        assert f"{name}:{port}" in targets
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert ds["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    assert all(p.startswith("127.0.0.1:") for svc in ("prometheus", "grafana") for p in compose["services"][svc]["ports"])
