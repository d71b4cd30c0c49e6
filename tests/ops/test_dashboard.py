"""docker/grafana/: the provisioning files and the dashboard JSON are well-formed, wired to each other and to
the compose stack, every panel query parses, and the panels cover what the issue asks for."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import yaml

from tests.ops.promql import (
    DASHBOARD,
    ROOT,
    adapter_rules,
    dashboard,
    dashboard_queries,
    exported_labels,
    metric_names,
    parse_with_promtool,
)

GRAFANA = ROOT / "docker" / "grafana"
PANEL_TYPES = {"timeseries", "stat", "bargauge", "gauge", "table", "heatmap", "text", "row"}


def _panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_json_top_level() -> None:
    d = dashboard()
    assert d["uid"] == "headbudget-overview" and d["title"]
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["time"]["from"].startswith("now-") and d["refresh"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("tier", "budget"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["allValue"] == ".*"
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", v["query"]["query"]).groups()
        assert label in exported_labels()[metric], f"variable {name}: {metric} has no label {label}"


def test_every_panel_has_valid_structure() -> None:
    for p in dashboard()["panels"]:
        assert p["type"] in PANEL_TYPES, p
        assert isinstance(p["id"], int) and p["title"].strip()
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert g["h"] >= 1 and g["w"] >= 1 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            assert g["w"] == 24 and g["h"] == 1 and p["panels"] == []
            continue
        assert p["description"].strip(), f"{p['title']}: describe what the panel shows"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"{p['title']}: no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and "legendFormat" in t and t["datasource"] == p["datasource"], p["title"]
        assert "unit" in p["fieldConfig"]["defaults"] and isinstance(p["fieldConfig"]["overrides"], list)
        assert isinstance(p["options"], dict)


def test_panels_do_not_overlap() -> None:
    cells = {}
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        for x, y in itertools.product(range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])):
            assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
            cells[(x, y)] = p["title"]


def test_every_panel_query_parses(tmp_path: Path) -> None:
    parse_with_promtool(dashboard_queries(), tmp_path)


def test_panels_cover_the_issue() -> None:
    """Requests and errors by tier, latency percentiles by tier and budget, compute spent and saved,
    online vs offline accuracy by budget, batch size, queue depth."""
    panels = _panels()

    def having(*metrics: str, by: str | None = None) -> list[str]:
        found = []
        for p in panels:
            exprs = " ".join(t["expr"] for t in p["targets"])
            if set(metrics) <= metric_names(exprs) and (by is None or re.search(rf"by \([^)]*\b{by}\b", exprs)):
                found.append(p["title"])
        return found

    assert having("headbudget_requests_total", by="tier")
    assert any("status" in t["expr"] and "2.." in t["expr"] for p in panels for t in p["targets"]), "errors"
    assert having("headbudget_request_duration_seconds_bucket", by="tier")
    assert having("headbudget_inference_duration_seconds_bucket", by="budget")
    assert having("headbudget_macs_total", "headbudget_macs_saved_total")  # the whole forward pass
    assert having("headbudget_online_accuracy", by="budget") and having("headbudget_offline_accuracy", by="budget")
    assert having("headbudget_batch_size_bucket") or having("headbudget_batch_size_sum")
    assert having("headbudget_queue_depth")
    assert having("headbudget_engine_tokens_total")  # the padding share: batches run in passes by length
    assert having("headbudget_compute_degraded_units_total", by="tier")  # the autoscaler's other signal
    quantiles = {q for p in panels for t in p["targets"]
                 for q in re.findall(r"histogram_quantile\((0\.\d+)", t["expr"])}
    assert {"0.5", "0.99"} <= quantiles


def test_degraded_compute_panel_marks_the_hpa_target() -> None:
    """The panel of degraded compute draws the HPA's target per pod and the same 5-minute rate the adapter serves."""
    hpa = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "base" / "hpa.yaml").read_text())
    target = next(float(m["pods"]["target"]["averageValue"]) for m in hpa["spec"]["metrics"]
                  if m["pods"]["metric"]["name"] == "headbudget_compute_degraded_units_per_second")
    (panel,) = [p for p in _panels()
                if any("headbudget_compute_degraded_units_total" in metric_names(t["expr"]) for t in p["targets"])]
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, target]
    (rule,) = [r for r in adapter_rules() if r["name"]["as"] == "headbudget_compute_degraded_units_per_second"]
    window = re.search(r"\[(\w+)\]", rule["metricsQuery"]).group(1)
    assert any(f"[{window}]" in t["expr"] and "by (instance)" in t["expr"] for t in panel["targets"])


def test_datasource_provisioning_matches_the_dashboard_and_compose() -> None:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["type"] == "prometheus" and ds["access"] == "proxy" and ds["isDefault"] is True
    assert ds["url"] == "http://prometheus:9090"  # the compose service name and port
    default = next(v for v in dashboard()["templating"]["list"] if v["name"] == "datasource")["current"]
    assert default["value"] == ds["uid"] and default["text"] == ds["name"]
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    assert ds["jsonData"]["timeInterval"] == scrape["global"]["scrape_interval"]


def test_dashboard_provider_points_at_the_mounted_dashboards() -> None:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "headbudget.yml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = {m["target"]: m["source"] for m in compose["services"]["grafana"]["volumes"] if isinstance(m, dict)}
    assert mounts[provider["options"]["path"]] == "./" + str(DASHBOARD.parent.relative_to(ROOT))
    assert mounts["/etc/grafana/provisioning"] == "./docker/grafana/provisioning"
