"""The metrics' names and budget labels, on the Metrics object itself (test_api reads them through /metrics)."""

from __future__ import annotations

from prometheus_client.metrics import MetricWrapperBase

from headbudget.service.metrics import Metrics, budget_bucket, budget_label

PREFIX = "headbudget_"


def test_budget_buckets() -> None:
    assert [budget_bucket(b) for b in (0.1, 0.14, 0.15, 0.25, 0.5, 0.95, 1.0)] == \
        ["0.1", "0.1", "0.2", "0.3", "0.5", "1.0", "1.0"]


def test_budget_labels_say_auto_only_for_an_uncapped_run_of_a_checkpoint_that_picks_its_own() -> None:
    assert budget_label(1.0, supports_auto=True) == "auto"
    assert budget_label(1.0, supports_auto=False) == "1.0"
    assert budget_label(0.5, supports_auto=True) == "0.5"
    metrics = Metrics()
    assert metrics.budget_label(0.5, auto=True) == "auto" and metrics.budget_label(0.54) == "0.5"


def test_each_metric_is_named_as_it_is_exported() -> None:
    """An attribute is its exported name without the prefix (and a counter's _total, which prometheus_client
    adds): one name per metric, in the code and on the dashboards."""
    metrics = Metrics()
    declared = {name: m for name, m in vars(metrics).items() if isinstance(m, MetricWrapperBase)}
    for attribute, metric in declared.items():
        assert metric._name == PREFIX + attribute, (attribute, metric._name)  # _name: without a counter's _total
    assert {PREFIX + a for a in declared} == {family.name for family in metrics.registry.collect()}
