"""End to end: the real service (`headbudget serve`, see live.py) answers traffic and feedback, a real
Prometheus scrapes it every second with docker/prometheus/alerts.yml loaded, and then every dashboard query,
every recorded series and every alert expression runs without error and returns data."""

from __future__ import annotations

import json
import random
import re
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.ops.live import (
    HOST,
    KEYS,
    LiveService,
    free_port,
    http,
    prometheus_exe,
    running_prometheus,
    wait_until,
)
from tests.ops.promql import (
    ALERTS,
    PROMETHEUS_YML,
    adapter_query,
    adapter_rules,
    dashboard_queries,
    promtool,
    rules,
)

pytestmark = pytest.mark.slow
RATE_INTERVAL = "1m"  # what $__rate_interval becomes: covers the whole traffic phase at a 1 s scrape interval
TEXTS = ["Stocks rallied after the central bank held rates steady.", "The striker scored twice in the final.",
         "A new browser update patches a security hole.", "Diplomats met for ceasefire talks at the border."]


def prom_query(url: str, expr: str) -> dict[str, Any]:
    """An instant query; the API's whole answer (status, data or error)."""
    status, body = http("GET", f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
    assert isinstance(body, dict), f"{status}: {body}"
    return body


@pytest.fixture(scope="module")
def prometheus(live_service: LiveService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """docker/prometheus/prometheus.yml with the API target on loopback and 1 s intervals; yields its URL."""
    prometheus_exe()
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(ALERTS)]
    for job in cfg["scrape_configs"]:
        target = f"{HOST}:{live_service.port}" if job["job_name"] == "headbudget" else f"{HOST}:{port}"
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [target]}]
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(cfg))
    with running_prometheus(config, tmp, port) as url:
        yield url


def _classify(service: LiveService, tier: str, body: dict[str, Any], query: str = "") -> tuple[int, Any]:
    return http("POST", f"{service.url}/classify{query}", body, {"X-API-Key": KEYS[tier]})


def drive_traffic(service: LiveService, rounds: int = 6) -> int:
    """Good, bad and feedback traffic spread over ``rounds`` seconds; returns the feedbacks accepted."""
    rng = random.Random(0)
    budgets = {"cheap": (0.2, 0.5), "balanced": (0.3, 0.5, 0.8), "quality": (0.5, 1.0)}
    feedbacks = 0
    for _ in range(rounds):
        started = time.monotonic()
        for tier, choices in budgets.items():
            for budget in choices:
                for body, query in (({"text": rng.choice(TEXTS), "budget": budget}, ""),
                                    ({"texts": rng.sample(TEXTS, 3)}, f"?budget={budget}")):
                    status, answer = _classify(service, tier, body, query)
                    assert status == 200, answer
                    # Feedback on the first text: half with the model's own label (correct), half another.
                    label = answer["results"][0]["label"]
                    if rng.random() < 0.5:
                        label = next(x for x in answer["results"][0]["scores"] if x != label)
                    status, fb = http("POST", f"{service.url}/feedback",
                                      {"request_id": answer["request_id"], "label": label, "index": 0},
                                      {"X-API-Key": KEYS[tier]})
                    assert status == 200, fb
                    feedbacks += 1
            assert _classify(service, tier, {"text": rng.choice(TEXTS), "max_latency_ms": 500})[0] == 200
            assert _classify(service, tier, {"text": rng.choice(TEXTS)})[0] == 200  # the tier's default
        # Errors the dashboard shows by tier and status.
        assert _classify(service, "cheap", {"text": TEXTS[0], "budget": 1.0})[0] == 403
        assert _classify(service, "balanced", {"text": "   "})[0] == 422
        assert http("POST", f"{service.url}/classify", {"text": TEXTS[0]}, {"X-API-Key": "hb-nope"})[0] == 401
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    return feedbacks


@pytest.fixture(scope="module")
def scraped(live_service: LiveService, prometheus: str) -> str:
    """Prometheus after it has scraped the traffic and evaluated its rules on it."""
    wait_until(lambda: prom_query(prometheus, 'up{job="headbudget"} == 1')["data"]["result"], 60,
               "prometheus scraping the service")
    feedbacks = drive_traffic(live_service)

    def caught_up() -> bool:
        r = prom_query(prometheus, "sum(headbudget_feedback_total)")["data"]["result"]
        return bool(r) and float(r[0]["value"][1]) >= feedbacks

    wait_until(caught_up, 60, "prometheus scraping the last of the traffic")
    time.sleep(3)  # a few rule evaluations after the last scrape
    return prometheus


def test_metrics_reach_prometheus_from_every_worker(live_service: LiveService, scraped: str) -> None:
    (up,) = prom_query(scraped, 'up{job="headbudget"}')["data"]["result"]
    assert up["value"][1] == "1"
    # /metrics aggregates the workers: the request count equals what was sent, whichever worker answered.
    r = prom_query(scraped, 'sum(headbudget_requests_total{status="200"})')["data"]["result"]
    per_round = 2 * (2 + 3 + 2) + 2 * 3  # two bodies per budget, plus max_latency_ms and default per tier
    assert float(r[0]["value"][1]) >= 6 * per_round


def test_live_metrics_pass_promtool_lint(live_service: LiveService, scraped: str) -> None:
    """Naming and type conventions of the exposition the service really serves, all workers aggregated."""
    status, text = http("GET", f"{live_service.url}/metrics")
    assert status == 200 and "headbudget_requests_total" in text
    proc = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_dashboard_query_runs_and_returns_data(scraped: str) -> None:
    problems = {}
    for name, expr in dashboard_queries(RATE_INTERVAL).items():
        answer = prom_query(scraped, expr)
        if answer["status"] != "success":
            problems[name] = answer.get("error")
        elif not answer["data"]["result"]:
            problems[name] = "no data"
    assert not problems, json.dumps(problems, indent=2)


def test_rules_evaluate_without_error(scraped: str) -> None:
    _, body = http("GET", f"{scraped}/api/v1/rules")
    evaluated = [r for g in body["data"]["groups"] for r in g["rules"]]
    assert len(evaluated) == len(rules())
    for r in evaluated:
        assert r["health"] == "ok" and not r.get("lastError"), r


def test_every_recorded_series_returns_data(scraped: str) -> None:
    empty = [r["record"] for r in rules() if "record" in r
             if not prom_query(scraped, r["record"])["data"]["result"]]
    assert not empty, f"recording rules without data: {empty}"


def alert_signals(expr: str) -> list[str]:
    """The parts of an alert expression without their threshold: `a > 0.05 and on (x) b >= 100` -> [a, b]."""
    parts = re.split(r"\s+and\s+(?:on\s*\([^)]*\)\s*)?", expr.strip())
    signals = []
    for part in parts:
        m = re.fullmatch(r"(.+?)\s*(?:==|!=|>=|<=|>|<)\s*[0-9.e+-]+", part.strip(), flags=re.S)
        assert m, f"alert expression part {part!r} is not `signal <op> threshold`: teach this test its shape"
        signals.append(m.group(1))
    return signals


def test_every_alert_expression_runs_and_its_signals_return_data(scraped: str) -> None:
    problems = {}
    for rule in (r for r in rules() if "alert" in r):
        answer = prom_query(scraped, rule["expr"])
        if answer["status"] != "success":
            problems[rule["alert"]] = answer.get("error")
            continue
        for signal in alert_signals(rule["expr"]):
            if not prom_query(scraped, signal)["data"]["result"]:
                problems[f"{rule['alert']}: {signal}"] = "no data"
    assert not problems, json.dumps(problems, indent=2)


def test_autoscaler_queries_return_data(scraped: str) -> None:
    """Each of prometheus-adapter's metricsQuery for the HPA, filled in as the adapter would (with the labels a
    Kubernetes scrape adds replaced by this scrape's own), returns a number per target: degraded compute too,
    which reads 0 rather than nothing on a server that has not degraded (test_autoscaling.py: the HPA's
    decision on these queries)."""
    for rule in adapter_rules():
        answer = prom_query(scraped, adapter_query(rule, 'job="headbudget"', "instance"))
        assert answer["status"] == "success" and len(answer["data"]["result"]) == 1, (rule["name"], answer)
        assert float(answer["data"]["result"][0]["value"][1]) >= 0


def test_online_and_offline_accuracy_share_budget_labels(scraped: str) -> None:
    online = {r["metric"]["budget"] for r in prom_query(scraped, "headbudget_online_accuracy")["data"]["result"]}
    offline = {r["metric"]["budget"] for r in prom_query(scraped, "headbudget_offline_accuracy")["data"]["result"]}
    assert online and online <= offline, (online, offline)


def test_alert_signal_parser() -> None:
    assert alert_signals("a:b:c > 0.05") == ["a:b:c"]
    assert alert_signals("x:y:z > 0.05\nand on (budget)\nq:r:s >= 100\n") == ["x:y:z", "q:r:s"]
    assert alert_signals('up{job="headbudget"} == 0') == ['up{job="headbudget"}']
    with pytest.raises(AssertionError):
        alert_signals("absent(up)")
