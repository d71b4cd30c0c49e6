"""Every Prometheus metric of the service, its labels and its buckets, declared in this one file.

Each metric's attribute is its exported name without ``headbudget_`` (and a counter's ``_total``). Labels are
tiers (never keys, but for the compute counters under ``[metrics] per_key``), HTTP status codes, and budgets
bucketed to 0.1 steps ("0.1" ... "1.0"), or "auto": on a checkpoint that predicts its own budget (BudgetFormer)
an uncapped run (``budget=auto``, or 1.0, which means no cap there); on a budgeted checkpoint with a decider every
``budget=auto`` run, whatever its ceiling. With several uvicorn workers, set PROMETHEUS_MULTIPROC_DIR (``headbudget
serve`` does): values then live in shared files and ``render`` aggregates them across workers.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import multiprocess as prom_mp
from prometheus_client.metrics import MetricWrapperBase

from headbudget.engine.types import Cost
from headbudget.service.settings import AUTO

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATIO_BUCKETS = tuple(round(0.1 * i, 1) for i in range(1, 11))


M = TypeVar("M", bound=MetricWrapperBase)


class Children(Generic[M]):
    """A labelled metric's children, each looked up once: ``labels()`` checks its arguments and takes a lock on
    every call, and every answer updates a dozen series."""

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


def budget_bucket(budget: float) -> str:
    """The 0.1-step label a budget is reported under ("0.1" ... "1.0")."""
    return f"{math.floor(budget * 10.0 + 0.5 + 1e-9) / 10.0:.1f}"


def budget_label(budget: float, supports_auto: bool) -> str:
    """The ``budget`` label of a run at ``budget``: "auto" for an uncapped run (1.0) of a checkpoint that predicts
    its own budget (there, 1.0 means no cap, which is what ``budget=auto`` runs), else its 0.1-step bucket."""
    return AUTO if supports_auto and budget >= 1.0 - 1e-9 else budget_bucket(budget)


def multiprocess_dir() -> str | None:
    """The prometheus-client multiprocess folder, when several workers share metrics."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Metrics:
    """The service's metrics; one instance per app, registered in its own registry."""

    def __init__(self, latency_targets_s: Iterable[float] = (), per_key: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # [metrics] per_key: the compute counters get a key label (the key's name): a series per key.
        self.per_key = per_key
        # answers observed and not yet counted: (tier, key, costs, degraded, charged, saved)
        self._answers: list[tuple[str, str, Sequence[Cost], bool, float, float]] = []
        self._declare_requests(latency_targets_s)
        self._declare_passes()
        self._declare_costs()
        self._declare_compute()
        self._declare_feedback()
        self._declare_state()
        # Set at start-up from the checkpoint: whether budget 1.0 is labelled "auto" (a checkpoint that predicts its
        # own budget, where a number is a cap and 1.0 is no cap).
        self.supports_auto = False

    def _declare_requests(self, latency_targets_s: Iterable[float]) -> None:
        """The API's requests: how many by status, and how long they took (the tiers' targets are buckets)."""
        r = self.registry
        request_buckets = tuple(sorted(set(LATENCY_BUCKETS_S) | {round(t, 6) for t in latency_targets_s}))
        self.requests = Counter("headbudget_requests_total", "API requests answered, by tier and HTTP status.",
                                ["tier", "status"], registry=r)
        self.request_duration_seconds = Histogram(
            "headbudget_request_duration_seconds", "Time from arrival to answer inside the server, by tier.",
            ["tier"], buckets=request_buckets, registry=r)
        self.degraded = Counter("headbudget_degraded_total",
                                "Requests run below their budget to meet the tier's latency target, by tier.",
                                ["tier"], registry=r)
        self.queue_depth = Gauge("headbudget_queue_depth", "Requests waiting for the model.", registry=r,
                                 multiprocess_mode="livesum")
        self._requests = Children(self.requests)
        self._request_duration_seconds = Children(self.request_duration_seconds)

    def _declare_passes(self) -> None:
        """The forward passes: wall time, CPU time, size and the tokens they ran."""
        r = self.registry
        self.inference_duration_seconds = Histogram(
            "headbudget_inference_duration_seconds", "Wall time of one batched forward pass, by budget bucket.",
            ["budget"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.engine_cpu_seconds = Counter(
            "headbudget_engine_cpu_seconds_total", "CPU time of the forward passes (tokenizing, running and "
            "answering a batch, on the thread that ran it; a priced request's texts are tokenized at admission, "
            "once, and that time counts here), by budget bucket: a process's CPU minus this is what serving costs "
            "besides the model.", ["budget"], registry=r)
        self.batch_size = Histogram("headbudget_batch_size", "Texts per forward pass.", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.engine_tokens = Counter(
            "headbudget_engine_tokens_total", "Tokens the forward passes ran: the texts' own (kind=text) and the "
            "padding that made a pass's texts one length (kind=padding).", ["kind"], registry=r)
        self._inference_duration_seconds = Children(self.inference_duration_seconds)
        self._engine_cpu_seconds, self._engine_tokens = Children(self.engine_cpu_seconds), Children(self.engine_tokens)

    def _declare_costs(self) -> None:
        """What each text spent: of the whole forward pass, and of its attention blocks alone."""
        r = self.registry
        self.cost_ratio = Histogram(
            "headbudget_cost_ratio", "Fraction of the dense whole forward pass's multiply-adds spent per text, "
            "by tier.", ["tier"], buckets=RATIO_BUCKETS, registry=r)
        self.macs = Counter("headbudget_macs_total", "Whole-forward multiply-adds spent, by tier.", ["tier"],
                            registry=r)
        self.macs_saved = Counter("headbudget_macs_saved_total", "Whole-forward multiply-adds saved "
                                  "against the dense model, by tier.", ["tier"], registry=r)
        self.attention_cost_ratio = Histogram(
            "headbudget_attention_cost_ratio", "Fraction of dense attention multiply-adds spent per text, by tier.",
            ["tier"], buckets=RATIO_BUCKETS, registry=r)
        self.attention_macs = Counter("headbudget_attention_macs_total", "Attention multiply-adds spent, by tier.",
                                      ["tier"], registry=r)
        self.attention_macs_saved = Counter("headbudget_attention_macs_saved_total",
                                            "Attention multiply-adds saved against the dense model, by tier.",
                                            ["tier"], registry=r)
        self._cost_ratio, self._attention_cost_ratio = Children(self.cost_ratio), Children(self.attention_cost_ratio)
        self._macs, self._macs_saved = Children(self.macs), Children(self.macs_saved)
        self._attention_macs, self._attention_macs_saved = (Children(self.attention_macs),
                                                            Children(self.attention_macs_saved))

    def _declare_compute(self) -> None:
        """Compute units: charged, saved, and taken by degrading (the autoscaler's signal)."""
        r = self.registry
        spend_labels = ["tier", "key"] if self.per_key else ["tier"]
        self.compute_units = Counter(
            "headbudget_compute_units", "Compute units charged for answered requests (one unit: the dense model's "
            "multiply-adds on one token at 128 tokens), by tier (and key with [metrics] per_key).", spend_labels,
            registry=r)
        self.compute_units_saved = Counter(
            "headbudget_compute_units_saved", "Compute units the answers did not spend against the dense model, by "
            "tier (and key with [metrics] per_key).", spend_labels, registry=r)
        self.compute_degraded_units = Counter(
            "headbudget_compute_degraded_units", "Compute requested but not run because the server lowered the "
            "budget to meet the tier's latency target, in compute units (the dense model's multiply-adds per token "
            "at 128 tokens), by tier: the autoscaler's signal of capacity short.", ["tier"], registry=r)
        self._compute_units, self._compute_units_saved = (Children(self.compute_units),
                                                          Children(self.compute_units_saved))

    def _declare_feedback(self) -> None:
        """Feedback outcomes and the accuracy per budget bucket, online and offline."""
        r = self.registry
        self.feedback = Counter("headbudget_feedback_total", "Feedback received, by budget bucket and outcome.",
                                ["budget", "correct"], registry=r)
        self.online_accuracy = Gauge(
            "headbudget_online_accuracy", "Accuracy over the recent feedback window, by budget bucket.",
            ["budget"], registry=r, multiprocess_mode="mostrecent")
        self.offline_accuracy = Gauge(
            "headbudget_offline_accuracy", "Accuracy measured offline (sweep.json), by budget bucket.",
            ["budget"], registry=r, multiprocess_mode="mostrecent")

    def _declare_state(self) -> None:
        """Whether the shared state store answers, and its failed operations."""
        r = self.registry
        self.state_backend_up = Gauge("headbudget_state_backend_up",
                                      "1 when the shared state store (Redis or memory) answers, else 0.", registry=r,
                                      multiprocess_mode="livemin")
        self.state_errors = Counter("headbudget_state_errors_total",
                                    "Failed shared-state operations, by operation.", ["operation"], registry=r)
        self.state_backend_up.set(1)

    def budget_label(self, budget: float, auto: bool = False) -> str:
        """The ``budget`` label of a run at ``budget`` (a cap, on checkpoints that predict their own); "auto" for
        a run through a decider (``auto``)."""
        return AUTO if auto else budget_label(budget, self.supports_auto)

    def observe_request(self, tier: str, status: int, seconds: float) -> None:
        """One API request answered."""
        self._requests(tier, str(status)).inc()
        self._request_duration_seconds(tier).observe(seconds)

    def observe_batch(self, budget: float, seconds: float, size: int, cpu_s: float, auto: bool = False,
                      tokens: tuple[int, int] = (0, 0)) -> None:
        """One forward pass (with ``auto``, a decider's passes for one batch): its wall time, its size, the CPU
        time it took and the tokens it ran (the texts' own, the padding)."""
        label = self.budget_label(budget, auto)
        self._inference_duration_seconds(label).observe(seconds)
        self._engine_cpu_seconds(label).inc(cpu_s)
        self.batch_size.observe(size)
        own, padding = tokens
        self._engine_tokens("text").inc(own)
        self._engine_tokens("padding").inc(padding)

    def observe_answer(self, tier: str, key: str, costs: Sequence[Cost], degraded: bool, charged: float,
                       saved: float) -> None:
        """One classify answer: each text's cost (whole forward pass and attention), whether it was degraded, and
        its charge and what that saved (compute units). Counted with the other answers of the loop's turn (a
        batch's answers arrive in one): its counters once a turn, not once a request; ``render`` counts what is
        pending first."""
        self._answers.append((tier, key, costs, degraded, charged, saved))
        if len(self._answers) == 1:
            try:
                asyncio.get_running_loop().call_soon(self.flush_answers)
            except RuntimeError:  # no loop (a script): now
                self.flush_answers()

    def flush_answers(self) -> None:
        """Count the answers observed since the last flush: histograms per text, counters once per series."""
        answers, self._answers = self._answers, []
        if not answers:
            return
        sums: dict[str, list[float]] = {}  # tier -> macs, saved, attention macs, attention saved, degraded
        spend: dict[tuple[str, ...], list[float]] = {}  # compute counters' labels -> charged, saved
        for tier, key, costs, degraded, charged, saved in answers:
            t = sums.setdefault(tier, [0, 0, 0, 0, 0])
            cost_ratio, attention_ratio = self._cost_ratio(tier), self._attention_cost_ratio(tier)
            for c in costs:
                # Under a decider's auto a text's passes add up: its attention blocks may cost more than one
                # dense pass's (two passes of a whole-model budget), which saved nothing rather than a negative
                # amount.
                cost_ratio.observe(c.ratio)
                attention_ratio.observe(c.attention_ratio)
                t[0] += c.total_macs
                t[1] += max(0, c.saved)
                t[2] += c.attention_macs
                t[3] += max(0, c.attention_saved)
            t[4] += degraded
            k = spend.setdefault((tier, key) if self.per_key else (tier,), [0.0, 0.0])
            k[0] += charged
            k[1] += saved
        for tier, (macs, macs_saved, attention, attention_saved, degraded_n) in sums.items():
            self._macs(tier).inc(macs)
            self._macs_saved(tier).inc(macs_saved)
            self._attention_macs(tier).inc(attention)
            self._attention_macs_saved(tier).inc(attention_saved)
            if degraded_n:
                self.degraded.labels(tier=tier).inc(degraded_n)
        for labels, (charged, saved) in spend.items():
            self._compute_units(*labels).inc(charged)
            self._compute_units_saved(*labels).inc(saved)

    def observe_degraded_compute(self, tier: str, units: float) -> None:
        """Compute units a request asked for but did not run because its budget was lowered."""
        if units > 0:
            self.compute_degraded_units.labels(tier=tier).inc(units)

    def declare_tiers(self, tiers: Iterable[str]) -> None:
        """Publish the per-tier counters the autoscaler reads at 0 before any traffic: a pod without the series
        has no value for prometheus-adapter, and a missing metric stops the HPA from scaling down."""
        for tier in tiers:
            self.compute_degraded_units.labels(tier=tier)

    def observe_feedback(self, budget_label: str, correct: bool, accuracy: float | None) -> None:
        """One feedback outcome and, when known, the budget's new rolling accuracy."""
        self.feedback.labels(budget=budget_label, correct=str(correct).lower()).inc()
        if accuracy is not None:
            self.online_accuracy.labels(budget=budget_label).set(accuracy)

    def set_state_up(self, up: bool) -> None:
        """Whether the shared-state backend answers."""
        self.state_backend_up.set(1 if up else 0)

    def set_offline_accuracy(self, points: Iterable[tuple[float, float]]) -> None:
        """Publish sweep.json's (budget, accuracy) points; the grid point nearest each 0.1 step wins."""
        best: dict[str, tuple[float, float]] = {}
        for budget, acc in points:
            label = self.budget_label(budget)
            dist = 0.0 if label == AUTO else abs(budget - float(label))
            if label not in best or dist < best[label][0]:
                best[label] = (dist, acc)
        for label, (_, acc) in best.items():
            self.offline_accuracy.labels(budget=label).set(acc)

    def render(self) -> tuple[bytes, str]:
        """The exposition text (aggregated over workers in multiprocess mode) and its content type."""
        self.flush_answers()
        if multiprocess_dir():
            registry = CollectorRegistry()
            prom_mp.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def mark_worker_dead(pid: int) -> None:
    """Drop a finished worker's live gauges from the multiprocess files."""
    if multiprocess_dir():
        prom_mp.mark_process_dead(pid)  # type: ignore[no-untyped-call]
