"""The HPA's decision, from prometheus-adapter's queries asked of a real Prometheus that holds real series: pods
that degrade compute for minutes with short queues get more replicas; a quiet server, a short burst of
degradation and the first minute of degradation do not; a long queue still does.

The series are what the ServiceMonitor scrapes every 15 s from pods in each situation (one namespace per
situation, two pods each), written as OpenMetrics and loaded into a fresh Prometheus with
`promtool tsdb create-blocks-from openmetrics`. Each adapter rule's metricsQuery
(deploy/kubernetes/prometheus-adapter/rules.yaml) is filled in as the adapter fills it for the HPA and asked of
that Prometheus through its HTTP API at a chosen time; the replica count then follows the HPA's algorithm
(autoscaling/v2: per metric ceil(current x average / target) unless within the 10% tolerance, the largest of the
metrics, within min and max replicas) with the targets of deploy/kubernetes/base/hpa.yaml. The rates below are
multiples of those targets, so the scenarios keep their meaning when a target is retuned."""

from __future__ import annotations

import math
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.ops.live import free_port, http, prometheus_exe, running_prometheus
from tests.ops.promql import ROOT, adapter_query, adapter_rules, promtool

HPA = ROOT / "deploy" / "kubernetes" / "base" / "hpa.yaml"
QUEUE = "headbudget_queue_depth"
DEGRADED = "headbudget_compute_degraded_units_per_second"
SCRAPE_S = 15  # the ServiceMonitor's interval
MINUTES = 25  # of series per pod
PODS = ("headbudget-7c9d8-k2x4p", "headbudget-7c9d8-w9m1z")
TIERS = ("cheap", "balanced", "quality")
TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance default
CURRENT = 2  # replicas running in every scenario (the base's minReplicas)


def hpa_spec() -> dict[str, Any]:
    return dict(yaml.safe_load(HPA.read_text())["spec"])


def target(metric: str) -> float:
    return next(float(m["pods"]["target"]["averageValue"]) for m in hpa_spec()["metrics"]
                if m["pods"]["metric"]["name"] == metric)


@dataclass(frozen=True)
class Pod:
    """What one pod shows over time (seconds since the series start)."""

    queue: Callable[[float], float]  # requests waiting
    degraded: Callable[[float], dict[str, float]]  # tier -> compute units per second degraded away
    restart_at_s: float | None = None  # the process restarts: its counters start again from 0


def _short_queue(t: float) -> float:
    return (0.0, 1.0, 2.0, 1.0)[int(t // SCRAPE_S) % 4]


def scenarios() -> dict[str, tuple[Pod, Pod]]:
    """namespace -> its two pods."""
    deg, queue = target(DEGRADED), target(QUEUE)

    def degrading(t: float) -> dict[str, float]:  # from minute 5: 2.5x the target, most of it cheap
        return {"cheap": 2.0 * deg, "balanced": 0.5 * deg} if t >= 300 else {}

    def burst(t: float) -> dict[str, float]:  # 30 s at 8x the target, at 14:30
        return {"cheap": 8.0 * deg} if 870 <= t < 900 else {}

    def none(t: float) -> dict[str, float]:
        return {}

    steady = Pod(_short_queue, degrading)
    return {
        "degrading": (steady, Pod(_short_queue, degrading, restart_at_s=720.0)),
        "burst": (Pod(lambda t: 3.0 if 870 <= t < 900 else 0.0, burst),) * 2,
        "quiet": (Pod(lambda t: 0.0, none),) * 2,
        "queued": (Pod(lambda t: 2.5 * queue, none),) * 2,
    }


def openmetrics(start: int) -> str:
    """Every pod's scrapes as OpenMetrics text, series by series."""
    times = [i * SCRAPE_S for i in range(MINUTES * 60 // SCRAPE_S + 1)]
    queue_lines, counter_lines = [], []
    for namespace, pods in scenarios().items():
        for index, (name, pod) in enumerate(zip(PODS, pods, strict=True)):
            labels = f'job="headbudget",namespace="{namespace}",pod="{name}",instance="10.0.{index}.7:8000"'
            queue_lines += [f"{QUEUE}{{{labels}}} {pod.queue(t)} {start + t}" for t in times]
            for tier in TIERS:
                value, last = 0.0, None
                for t in times:
                    if last is not None:
                        restarted = pod.restart_at_s is not None and last < pod.restart_at_s <= t
                        value = 0.0 if restarted else value + pod.degraded(last).get(tier, 0.0) * SCRAPE_S
                    counter_lines.append(
                        f'headbudget_compute_degraded_units_total{{{labels},tier="{tier}"}} {value} {start + t}')
                    last = t
    return "\n".join([f"# TYPE {QUEUE} gauge", *queue_lines, "# TYPE headbudget_compute_degraded_units counter",
                      *counter_lines, "# EOF", ""])


@dataclass(frozen=True)
class Backfilled:
    url: str
    start: int  # unix time of the first scrape

    def query(self, expr: str, at_s: float) -> list[dict[str, Any]]:
        """An instant query at ``at_s`` seconds after the first scrape."""
        params = urllib.parse.urlencode({"query": expr, "time": self.start + at_s})
        status, body = http("GET", f"{self.url}/api/v1/query?{params}")
        assert status == 200 and body["status"] == "success", body
        return list(body["data"]["result"])


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backfilled]:
    prometheus_exe()
    tmp = tmp_path_factory.mktemp("prometheus-backfill")
    # Three hours back: outside the head block a fresh server starts, inside its retention.
    start = (int(time.time()) // 60 - 180) * 60
    (tmp / "series.om").write_text(openmetrics(start))
    proc = subprocess.run([promtool(), "tsdb", "create-blocks-from", "openmetrics", str(tmp / "series.om"),
                           str(tmp / "data")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp / "prometheus.yml").write_text("global: {}\n")
    with running_prometheus(tmp / "prometheus.yml", tmp, free_port()) as url:
        yield Backfilled(url, start)


def pod_values(prom: Backfilled, metric: str, namespace: str, at_s: float) -> dict[str, float]:
    """What the adapter answers the HPA for ``metric`` on the namespace's pods: pod -> value."""
    (rule,) = [r for r in adapter_rules() if r["name"]["as"] == metric]
    expr = adapter_query(rule, f'namespace="{namespace}",pod=~"{"|".join(PODS)}"', "pod")
    return {r["metric"]["pod"]: float(r["value"][1]) for r in prom.query(expr, at_s)}


def decide(prom: Backfilled, namespace: str, at_s: float) -> tuple[int, dict[str, int]]:
    """(desired replicas, each metric's proposal) for the namespace's Deployment of CURRENT pods."""
    spec = hpa_spec()
    proposals = {}
    for m in spec["metrics"]:
        name = m["pods"]["metric"]["name"]
        values = pod_values(prom, name, namespace, at_s)
        # A pod without a value makes the metric fail, and a failing metric stops the HPA from scaling down.
        assert set(values) == set(PODS), f"{name} at {at_s:g} s: values {values}"
        ratio = sum(values.values()) / len(values) / float(m["pods"]["target"]["averageValue"])
        proposals[name] = CURRENT if abs(ratio - 1.0) <= TOLERANCE else math.ceil(ratio * CURRENT)
    return min(spec["maxReplicas"], max(spec["minReplicas"], *proposals.values())), proposals


def test_the_hpa_scales_on_exactly_these_two_metrics() -> None:
    assert {m["pods"]["metric"]["name"] for m in hpa_spec()["metrics"]} == {QUEUE, DEGRADED}
    assert hpa_spec()["minReplicas"] == CURRENT


@pytest.mark.parametrize("minute", [10, 14, 20, 25])
def test_sustained_degradation_with_short_queues_scales_out(prometheus: Backfilled, minute: int) -> None:
    """Minute 14 reads across the second pod's restart at 12 (its counters start again from 0)."""
    desired, proposals = decide(prometheus, "degrading", minute * 60)
    assert desired > CURRENT and proposals[DEGRADED] == desired, proposals
    assert proposals[QUEUE] <= CURRENT, proposals  # the queue alone looks healthy
    values = pod_values(prometheus, DEGRADED, "degrading", minute * 60)
    for pod, value in values.items():  # 2.5x the target per pod, less the restart's lost scrape
        assert 2.2 * target(DEGRADED) <= value <= 2.75 * target(DEGRADED), (pod, value)


def test_the_first_minute_of_degradation_does_not_scale_out(prometheus: Backfilled) -> None:
    desired, proposals = decide(prometheus, "degrading", 6 * 60)
    assert desired == CURRENT, proposals
    assert all(v > 0 for v in pod_values(prometheus, DEGRADED, "degrading", 6 * 60).values())


@pytest.mark.parametrize("seconds", [900, 960, 1140])
def test_a_burst_of_degradation_does_not_scale_out(prometheus: Backfilled, seconds: int) -> None:
    desired, proposals = decide(prometheus, "burst", seconds)
    assert desired == CURRENT, proposals


def test_the_burst_was_above_the_target_while_it_lasted(prometheus: Backfilled) -> None:
    """The 5-minute window, not a small burst, keeps it from scaling: over 1 minute it reads 4x the target."""
    per_minute = prometheus.query(
        'sum by (pod) (rate(headbudget_compute_degraded_units_total{namespace="burst"}[1m]))', 900)
    assert len(per_minute) == 2 and all(float(r["value"][1]) > 3 * target(DEGRADED) for r in per_minute)


@pytest.mark.parametrize("minute", [5, 20, 25])
def test_a_quiet_server_does_not_scale_out(prometheus: Backfilled, minute: int) -> None:
    desired, proposals = decide(prometheus, "quiet", minute * 60)
    assert desired == CURRENT and proposals == {QUEUE: 0, DEGRADED: 0}, proposals
    for metric in (QUEUE, DEGRADED):  # every pod answers 0: the counters exist from start-up
        assert pod_values(prometheus, metric, "quiet", minute * 60) == dict.fromkeys(PODS, 0.0)


def test_a_long_queue_still_scales_out(prometheus: Backfilled) -> None:
    desired, proposals = decide(prometheus, "queued", 20 * 60)
    assert desired > CURRENT and proposals[QUEUE] == desired and proposals[DEGRADED] == 0, proposals


def test_scenarios_are_written_as_scraped() -> None:
    """The OpenMetrics text has every pod, tier and scrape, and the degrading pods' counters only grow except
    at the restart."""
    text = openmetrics(0)
    scrapes = MINUTES * 60 // SCRAPE_S + 1
    assert text.count("headbudget_compute_degraded_units_total{") == len(scenarios()) * 2 * len(TIERS) * scrapes
    assert text.count(f"{QUEUE}{{") == len(scenarios()) * 2 * scrapes
    cheap = [float(line.split()[1]) for line in text.splitlines()
             if 'namespace="degrading"' in line and PODS[1] in line and 'tier="cheap"' in line]
    drops = [i for i in range(1, len(cheap)) if cheap[i] < cheap[i - 1]]
    assert drops == [720 // SCRAPE_S]
