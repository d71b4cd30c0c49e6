"""PromQL helpers for the ops tests: parse with promtool, the metric names the service exports, Grafana
variables, and the queries of the dashboard and the alert rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
PROMETHEUS_YML = ROOT / "docker" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "headbudget.json"
ADAPTER_RULES = ROOT / "deploy" / "kubernetes" / "prometheus-adapter" / "rules.yaml"

# Names that are not ours but may appear in queries.
PROMETHEUS_BUILTIN = {"up"}
_METRIC = re.compile(r"(?<![\w:$])(headbudget_[a-z0-9_]+)(?![\w:])")
_RECORDED = re.compile(r"(?<![\w$])([a-z_]+:headbudget_[a-z0-9_]+:[a-z0-9_]+)(?![\w:])")


def promtool() -> str:
    """The promtool binary, or skip."""
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make system-deps`)")
    return exe


def grafana_to_promql(expr: str, rate_interval: str = "1m") -> str:
    """A dashboard query with Grafana's variables replaced by values Prometheus accepts."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
            .replace("$__range", rate_interval).replace("$tier", ".*").replace("$budget", ".*"))


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(rate_interval: str = "1m") -> dict[str, str]:
    """"<panel title> / <refId>" -> PromQL, for every query panel of the dashboard."""
    out = {}
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out[f"{panel['title']} / {target['refId']}"] = grafana_to_promql(target["expr"], rate_interval)
    return out


def rules() -> list[dict[str, Any]]:
    """Every rule (recording and alerting) of docker/prometheus/alerts.yml."""
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def parse_with_promtool(exprs: dict[str, str], tmp: Path) -> None:
    """Fail unless promtool parses every expression (checked as recording rules of a scratch file)."""
    exe = promtool()
    names = list(exprs)
    doc = {"groups": [{"name": "parse", "rules": [{"record": f"parse:check:n{i}", "expr": exprs[n]}
                                                  for i, n in enumerate(names)]}]}
    path = tmp / "parse-rules.yml"
    path.write_text(yaml.safe_dump(doc, width=1000))
    proc = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        bad = {f"n{i}": n for i, n in enumerate(names)}
        pytest.fail(f"promtool rejects a query ({bad}):\n{proc.stdout}{proc.stderr}")


def adapter_rules() -> list[dict[str, Any]]:
    """prometheus-adapter's rules (deploy/kubernetes/prometheus-adapter/rules.yaml)."""
    return list(yaml.safe_load(ADAPTER_RULES.read_text())["rules"])


def adapter_series(rule: dict[str, Any]) -> str:
    """The series name an adapter rule's seriesQuery selects (what the adapter puts in ``<<.Series>>``)."""
    m = re.match(r"\s*([a-zA-Z_:][\w:]*)\s*\{", rule["seriesQuery"])
    assert m, f"seriesQuery {rule['seriesQuery']!r} does not start with a series name"
    return m.group(1)


def adapter_query(rule: dict[str, Any], label_matchers: str, group_by: str) -> str:
    """An adapter rule's metricsQuery filled in as the adapter fills it for one HPA request: the series, the
    selected objects' labels (``namespace="ns",pod=~"a|b"``) and the label it groups by (``pod``)."""
    return (rule["metricsQuery"].replace("<<.Series>>", adapter_series(rule))
            .replace("<<.LabelMatchers>>", label_matchers).replace("<<.GroupBy>>", group_by))


def metric_names(expr: str) -> set[str]:
    """The raw headbudget_* metric names an expression reads (recorded series excluded)."""
    return set(_METRIC.findall(_RECORDED.sub(" ", expr)))


def recorded_names(expr: str) -> set[str]:
    """The recorded series (level:metric:operation) an expression reads."""
    return set(_RECORDED.findall(expr))


def exported_series_names() -> set[str]:
    """Every sample name the service's metrics can produce (histograms: _bucket, _sum, _count)."""
    from headbudget.service.metrics import Metrics

    names = set()
    for family in Metrics().registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{s}" for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def exported_labels() -> dict[str, set[str]]:
    """Sample name -> its label names (histogram buckets add "le")."""
    from headbudget.service.metrics import Metrics

    out: dict[str, set[str]] = {}
    # The registry's private map is the only place that lists a labelled metric's names before any sample.
    for collector, names in Metrics().registry._collector_to_names.items():
        labels = set(getattr(collector, "_labelnames", ()))
        for name in names:
            out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return out
