"""docker/prometheus/: promtool accepts the configuration and the rules, the alerts fire on the traffic they are
meant for (promtool unit tests), and every query reads metrics and labels the service really exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ops.promql import (
    ALERTS,
    PROMETHEUS_BUILTIN,
    PROMETHEUS_YML,
    ROOT,
    dashboard_queries,
    exported_labels,
    exported_series_names,
    metric_names,
    promtool,
    recorded_names,
    rules,
)

ALERTS_TEST = Path(__file__).with_name("prometheus") / "alerts_test.yml"
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_promtool_check_config() -> None:
    proc = _promtool("check", "config", str(PROMETHEUS_YML))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_promtool_check_rules() -> None:
    proc = _promtool("check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alerts_fire_as_specified_by_promtool_unit_tests() -> None:
    proc = _promtool("test", "rules", str(ALERTS_TEST))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_unit_test() -> None:
    tested = {case["alertname"] for t in yaml.safe_load(ALERTS_TEST.read_text())["tests"]
              for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts - tested == set(), "alerts without a firing promtool test"


def test_alerts_cover_what_an_operator_needs() -> None:
    by_name = {r.get("alert") or r.get("record"): r for r in rules()}
    alerts = [r for r in rules() if "alert" in r]

    def reads(alert: dict, metric: str) -> bool:
        exprs = [alert["expr"]] + [by_name[n]["expr"] for n in recorded_names(alert["expr"])]
        return any(metric in e for e in exprs)

    wanted = {  # what the issue asks for -> a raw metric the alert must be built on
        "error rate": ('status=~"5.."', "headbudget_requests_total"),
        "p99 latency": ("histogram_quantile(0.99", "headbudget_request_duration_seconds_bucket"),
        "queue depth": ("", "headbudget_queue_depth"),
        "online vs offline accuracy": ("headbudget_offline_accuracy", "headbudget_online_accuracy"),
    }
    for what, (a, b) in wanted.items():
        assert any(reads(al, a) and reads(al, b) for al in alerts), f"no alert on {what}"


def test_alert_metadata_and_runbooks() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", operations, flags=re.M)}
    for rule in rules():
        if "alert" not in rule:
            assert re.fullmatch(r"[a-z_]+:headbudget_[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]
            continue
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert anchor in anchors, f"{rule['alert']}: docs/operations.md has no section #{anchor}"
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), f"{rule['alert']}: give it a `for:`"


def test_recorded_series_are_defined_before_use() -> None:
    defined: set[str] = set()
    for rule in rules():
        missing = recorded_names(rule["expr"]) - defined
        assert not missing, f"{rule.get('alert') or rule.get('record')} reads undefined {missing}"
        if "record" in rule:
            defined.add(rule["record"])


def _queries() -> dict[str, str]:
    return {**{f"rule {r.get('alert') or r.get('record')}": r["expr"] for r in rules()},
            **{f"panel {k}": v for k, v in dashboard_queries().items()}}


def test_queries_read_only_metrics_the_service_exports() -> None:
    exported = exported_series_names() | PROMETHEUS_BUILTIN
    for name, expr in _queries().items():
        unknown = metric_names(expr) - exported
        assert not unknown, f"{name} reads {unknown}, which service/metrics.py does not export"


def test_queries_use_only_labels_the_metrics_have() -> None:
    labels = exported_labels()
    recorded_labels = {"tier", "budget", "job", "instance"}
    for name, expr in _queries().items():
        allowed = set(TARGET_LABELS) | recorded_labels if recorded_names(expr) else set(TARGET_LABELS)
        for metric in metric_names(expr):
            allowed |= labels[metric]
        used = set()
        for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
            used |= {x.strip() for x in group.split(",") if x.strip()}
        used |= set(re.findall(r"[{,]\s*([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", expr))
        used -= {"__name__"}
        assert used <= allowed, f"{name} uses labels {used - allowed} that its metrics do not have"


def test_scrape_config_targets_the_api() -> None:
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "headbudget")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    sd = job["dns_sd_configs"][0]
    assert sd["names"] == ["api"] and sd["port"] == 8000  # the compose service and its port
    assert cfg["rule_files"] == ["alerts.yml"]
    # The alerts select job="headbudget": the scrape job (and the Kubernetes Service) must be named so.
    assert all('job="headbudget"' in r["expr"] for r in rules() if "up{" in r["expr"])


@pytest.mark.parametrize("broken", ["rate(headbudget_requests_total[5m]", "sum by tier (x)"])
def test_promtool_rejects_broken_rules(tmp_path: Path, broken: str) -> None:
    """The checks above would catch a typo: promtool fails on a broken expression."""
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "a:b:c", "expr": broken}]}]}))
    assert _promtool("check", "rules", str(path)).returncode != 0
