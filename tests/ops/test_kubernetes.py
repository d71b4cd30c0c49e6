"""deploy/kubernetes/: `kubectl kustomize` renders the base, the example overlay and the adapter config; every
object validates against the Kubernetes schemas (kubernetes-validate, strict); the Prometheus Operator objects
against the subset schemas in tests/ops/schemas/ (see its README.md); and the objects are wired to each other:
selectors, ports, the HPA's metric and the adapter rule, probes, drain timing, the configuration."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from headbudget.service.settings import parse_config
from tests.ops.promql import (
    ADAPTER_RULES,
    ALERTS,
    ROOT,
    adapter_query,
    adapter_series,
    exported_series_names,
    parse_with_promtool,
)

K8S = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).with_name("schemas")
KUSTOMIZATIONS = ["base", "overlays/example"]
API_LABELS = {"app.kubernetes.io/name": "headbudget", "app.kubernetes.io/component": "api"}


@cache
def render(path: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (Debian package kubernetes-client; `make system-deps`)")
    proc = subprocess.run([kubectl, "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def api_container(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment", "headbudget")["spec"]["template"]["spec"]["containers"]
    return c


def service_config(docs: tuple[dict[str, Any], ...]) -> Any:
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("headbudget-config"))
    return parse_config(tomllib.loads(cm["data"]["service.toml"]))


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_renders_every_object_the_issue_asks_for(path: str) -> None:
    kinds = Counter(d["kind"] for d in render(path))
    wanted = Counter({"Deployment": 2, "Service": 2, "ConfigMap": 1, "HorizontalPodAutoscaler": 1,
                      "PodDisruptionBudget": 1, "ServiceMonitor": 1, "PrometheusRule": 1})
    assert wanted <= kinds, kinds


@pytest.mark.parametrize("version", ["1.29.0", "1.32.0", "latest"])
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_builtin_objects_validate_strictly(path: str, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra)")
    version = kv.utils.latest_version() if version == "latest" else version
    checked = 0
    for doc in render(path):
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({version}): "
                        f"{'.'.join(map(str, e.path))}: {e.message}")
        checked += 1
    assert checked >= 7


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_prometheus_operator_objects_validate_against_subset_schemas(path: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra)")
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    definitions = kv.utils.schema_contents(
        f"kubernetes-json-schema/v{kv.utils.latest_version()}-local-strict/_definitions.json", "latest")
    for doc in render(path):
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        schema = json.loads((SCHEMAS / f"{doc['kind'].lower()}-monitoring-v1.json").read_text())
        registry = Resource.from_contents(schema) @ (Resource.from_contents(definitions) @ Registry())
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in Draft202012Validator(schema, registry=registry).iter_errors(doc)]
        assert not errors, f"{doc['kind']}: {errors}"


def test_subset_schema_rejects_a_typo() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra)")
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    definitions = kv.utils.schema_contents(
        f"kubernetes-json-schema/v{kv.utils.latest_version()}-local-strict/_definitions.json", "latest")
    schema = json.loads((SCHEMAS / "servicemonitor-monitoring-v1.json").read_text())
    registry = Resource.from_contents(schema) @ (Resource.from_contents(definitions) @ Registry())
    doc = json.loads(json.dumps(one(render("base"), "ServiceMonitor")))
    doc["spec"]["endpoints"][0]["scrapeInterval"] = "15s"
    doc["metadata"]["labels"]["bad label!"] = "x"
    assert len(list(Draft202012Validator(schema, registry=registry).iter_errors(doc))) >= 1


def test_selectors_and_ports_are_wired() -> None:
    docs = render("base")
    deploy = one(docs, "Deployment", "headbudget")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"] == API_LABELS and API_LABELS.items() <= pod_labels.items()
    svc = one(docs, "Service", "headbudget")
    assert svc["spec"]["selector"] == API_LABELS
    container_ports = {p["name"]: p["containerPort"] for p in api_container(docs)["ports"]}
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in container_ports and svc_port["name"] == "http"
    mon = one(docs, "ServiceMonitor")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    assert mon["spec"]["endpoints"][0]["path"] == "/metrics"
    # The alerts select job="headbudget"; the Operator names the job after the Service.
    assert svc["metadata"]["name"] == "headbudget" and "jobLabel" not in mon["spec"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == API_LABELS
    redis = one(docs, "Deployment", "headbudget-redis")
    assert one(docs, "Service", "headbudget-redis")["spec"]["selector"] == \
        redis["spec"]["template"]["metadata"]["labels"] == redis["spec"]["selector"]["matchLabels"]
    configmaps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    volumes = deploy["spec"]["template"]["spec"]["volumes"]
    assert {v["configMap"]["name"] for v in volumes if "configMap" in v} <= configmaps


def test_probes_drain_and_resources() -> None:
    docs = render("base")
    deploy = one(docs, "Deployment", "headbudget")
    pod = deploy["spec"]["template"]["spec"]
    c = api_container(docs)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) >= 5
    cfg = service_config(docs)
    assert pod["terminationGracePeriodSeconds"] > int(sleep[1]) + cfg.server.graceful_timeout_s
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # One engine thread per worker: the pod asks for one CPU per worker, with requests = limits.
    workers = int(next(e["value"] for e in c["env"] if e["name"] == "WORKERS"))
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert int(c["resources"]["requests"]["cpu"]) == workers
    assert workers == 1 or cfg.state.redis_url, "several workers need shared state"
    sc, psc = c["securityContext"], pod["securityContext"]
    assert psc["runAsNonRoot"] and psc["runAsUser"] == 10001 and sc["readOnlyRootFilesystem"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/etc/headbudget", "/tmp"} <= mounts  # config file; multiprocess metrics and graph cache


def test_service_toml_points_at_the_redis_service() -> None:
    for path in KUSTOMIZATIONS:
        docs = render(path)
        cfg = service_config(docs)
        m = re.fullmatch(r"redis://([\w.-]+):(\d+)/\d+", cfg.state.redis_url)
        assert m, cfg.state.redis_url
        redis = one(docs, "Service", m.group(1))
        assert int(m.group(2)) in {p["port"] for p in redis["spec"]["ports"]}


def test_hpa_scales_the_deployment_on_the_adapter_metrics(tmp_path: Path) -> None:
    """Queue depth and degraded compute, each a per-pod metric served by one adapter rule (how the HPA decides on
    them against real series: test_autoscaling.py)."""
    docs = render("base")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "headbudget"}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    metrics = hpa["spec"]["metrics"]
    assert all(m["type"] == "Pods" and m["pods"]["target"]["type"] == "AverageValue" for m in metrics)
    assert all(float(m["pods"]["target"]["averageValue"]) > 0 for m in metrics)
    rules_doc = yaml.safe_load(ADAPTER_RULES.read_text())
    by_name = {r["name"]["as"]: r for r in rules_doc["rules"]}
    names = [m["pods"]["metric"]["name"] for m in metrics]
    assert sorted(names) == sorted(by_name), "every HPA metric needs an adapter rule, every rule feeds the HPA"
    assert set(names) == {"headbudget_queue_depth", "headbudget_compute_degraded_units_per_second"}
    exported = exported_series_names()
    filled = {}
    for name, rule in by_name.items():
        series = adapter_series(rule)
        assert series in exported, f"{name}: the service exports no {series}"
        assert re.fullmatch(rule["name"]["matches"], series)
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}
        filled[name] = adapter_query(rule, 'namespace="ns",pod=~"headbudget-.*"', "pod")
        filled[f"{name} series"] = rule["seriesQuery"]
    # Degraded compute is a counter: the adapter serves its rate, over minutes so that only sustained
    # degradation counts.
    degraded = by_name["headbudget_compute_degraded_units_per_second"]["metricsQuery"]
    window = re.fullmatch(r"sum by \(<<\.GroupBy>>\) \(rate\(<<\.Series>>\{<<\.LabelMatchers>>\}\[(\d+)m\]\)\)",
                          degraded)
    assert window and int(window.group(1)) >= 2, degraded
    helm = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    assert helm["rules"]["custom"] == rules_doc["rules"], "values.yaml and rules.yaml disagree"
    # Every query parses once the adapter's templates are filled in as it would.
    parse_with_promtool(filled, tmp_path)
    # The adapter kustomization ships exactly that file.
    (cm,) = render("prometheus-adapter")
    assert yaml.safe_load(cm["data"]["config.yaml"]) == rules_doc


def test_prometheus_rule_equals_the_compose_alerts() -> None:
    rule = one(render("base"), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"], \
        "regenerate deploy/kubernetes/base/prometheusrule.yaml from docker/prometheus/alerts.yml"


def test_overlay_overrides_image_namespace_and_config() -> None:
    docs = render("overlays/example")
    assert all(d["metadata"].get("namespace") == "headbudget" for d in docs if d["kind"] != "Namespace")
    assert api_container(docs)["image"] == "registry.example.com/headbudget:0.1.0-quick"
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert one(docs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    base_cm = next(d for d in render("base") if d["kind"] == "ConfigMap")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cm["data"] != base_cm["data"] and cm["metadata"]["name"] != base_cm["metadata"]["name"]
    deploy = one(docs, "Deployment", "headbudget")
    assert cm["metadata"]["name"] in json.dumps(deploy), "the Deployment must mount the hashed ConfigMap"
    assert re.fullmatch(r"[\w.-]+:[\w.-]+", api_container(render("base"))["image"])


def test_redis_keeps_usage_across_restarts() -> None:
    """Usage per key and day is billing data that never expires: Redis appends it to a file on a persistent
    volume (an emptyDir or no append-only file would lose it with the pod)."""
    docs = render("base")
    pod = one(docs, "Deployment", "headbudget-redis")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--dir") + 1] == "/data"
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/data")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert one(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_the_usage_journal_is_on_a_volume() -> None:
    """Usage Redis could not take waits in [state] journal_dir: on a volume of the pod (the image is read-only), so
    that a restarted container replays it."""
    docs = render("base")
    folder = service_config(docs).state.journal_dir
    assert folder, "the base config keeps no journal"
    pod = one(docs, "Deployment", "headbudget")["spec"]["template"]["spec"]
    mount = next(m for m in api_container(docs)["volumeMounts"] if m["mountPath"] == folder)
    assert not mount.get("readOnly") and any(v["name"] == mount["name"] for v in pod["volumes"])


# -- memory: the pass cap and the memory limit agree ------------------------------------------------------------
# A worker of the quick checkpoint measured under the largest requests the API admits (64 texts of 512 tokens at
# several budgets, from several keys at once): idle, peak over idle at its [server] max_activation_mb, and what
# runs beside the workers of a two-worker server (`python -m headbudget.loadtest.memory`, docs/results.md).
MEMORY = ROOT / "docs" / "results" / "ag_news" / "model-quick" / "memory.json"
WORKER_MARGIN_MB = 64  # per worker beyond idle and its passes: request bodies and tokens in flight


def mib(quantity: str) -> float:
    """A Kubernetes or Compose memory quantity in MiB (3Gi, 1536Mi, 4g, 512m)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|k|K|M|G|kb|mb|gb|m|g)?", quantity.strip())
    assert m, quantity
    unit = m.group(2) or ""
    scale = {"": 2**-20, "Ki": 2**-10, "k": 1000 / 2**20, "K": 1000 / 2**20, "kb": 2**-10, "Mi": 1.0,
             "M": 1e6 / 2**20, "m": 1.0, "mb": 1.0, "Gi": 1024.0, "G": 1e9 / 2**20, "g": 1024.0, "gb": 1024.0}
    return float(m.group(1)) * scale[unit]


def memory_needed_mib(workers: int, cap_mb: int) -> float:
    """Every worker at its peak at once: its idle memory, its passes' (the measured peak over idle per MiB of cap,
    at least 1.5: ONNX Runtime's arena rounds regions up) and a margin; with several, what runs beside them."""
    m = json.loads(MEMORY.read_text())
    per_mib_of_cap = max(m["peak_over_idle_mb"] / m["max_activation_mb"], 1.5)
    beside = m["beside_workers_mb"] if workers > 1 else 0
    return workers * (m["idle_mb"] + per_mib_of_cap * cap_mb + WORKER_MARGIN_MB) + beside


def test_the_memory_figures_were_measured_under_the_largest_admitted_requests() -> None:
    m = json.loads(MEMORY.read_text())
    assert m["texts"] == 64 and m["max_length"] == 512 and m["precision"] == "int8"
    assert all(s == 200 for r in m["requests"] for s in r["status"])
    assert len({r["budget"] if r["keys"] == 1 else None for r in m["requests"]}) >= 3
    assert any(r["keys"] > 1 for r in m["requests"])
    assert m["peak_over_idle_mb"] <= 300 and m["after_over_idle_mb"] <= 64


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_the_pod_memory_limit_holds_its_workers_at_their_pass_cap(path: str) -> None:
    docs = render(path)
    c = api_container(docs)
    workers = int(next(e["value"] for e in c["env"] if e["name"] == "WORKERS"))
    cap = service_config(docs).server.max_activation_mb
    limit = mib(c["resources"]["limits"]["memory"])
    assert memory_needed_mib(workers, cap) <= limit, (workers, cap, limit)


def test_the_compose_memory_limit_holds_its_workers_at_their_pass_cap() -> None:
    from headbudget.service.settings import load_config

    api = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["api"]
    workers = int(api["environment"]["WORKERS"])
    (config,) = [m["source"] for m in api["volumes"] if m["target"] == "/etc/headbudget/service.toml"]
    cap = load_config(ROOT / config).server.max_activation_mb
    limit = mib(api["deploy"]["resources"]["limits"]["memory"])
    assert memory_needed_mib(workers, cap) <= limit, (workers, cap, limit)


def test_a_cap_too_large_for_the_limit_is_caught() -> None:
    """The check is real: 2 workers at a 2 GiB cap do not fit the base's limit."""
    limit = mib(api_container(render("base"))["resources"]["limits"]["memory"])
    assert memory_needed_mib(2, 2048) > limit
