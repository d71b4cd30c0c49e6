"""Figures: accuracy vs cost and vs measured latency (pareto.png), and the adaptive types' reports."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from headbudget.models.config import SCOPE_SPECS  # noqa: E402

# Per bench precision: the sweep column of its hard accuracy, and the bench's all-units ONNX Runtime peer.
_HARD_COLUMN = {"fp32": "accuracy_hard", "int8": "accuracy_hard_int8"}
_PEER = {"fp32": "ort_fp32_ms", "int8": "ort_int8_ms"}
# The "mode" of a `headbudget bench --all-budgets` file (experiments/budget_bench.py; training may not import it).
_ALL_BUDGETS = "all-budgets"


def load_benches(*folders: Path) -> list[dict[str, Any]]:
    """The ``headbudget bench`` documents found in ``folders`` (bench*.json, and the all-budget files
    *budgets.json), each file once."""
    import json

    docs, seen = [], set()
    for folder in folders:
        paths = sorted({*Path(folder).glob("bench*.json"), *Path(folder).glob("*budgets.json")})
        for path in paths:
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("rows"), list):
                docs.append(doc)
    return docs


def latency_tables(benches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bench documents the latency panel draws: an all-budget file stands in for the bench.json of the same
    precision and lengths (it times every budget of the grid, bench.json five), and without one every
    document is drawn as before."""
    def key(doc: dict[str, Any]) -> tuple[str, str]:
        return str(doc.get("precision", "fp32")), str(doc.get("seq_len"))

    covered = {key(d) for d in benches if d.get("mode") == _ALL_BUDGETS}
    return [d for d in benches if d.get("mode") == _ALL_BUDGETS or key(d) not in covered]


def pareto_plot(sweep: dict[str, Any], path: Path, title: str | None = None,
                benches: list[dict[str, Any]] | None = None, auto: dict[str, Any] | None = None) -> Path:
    """Accuracy vs cost (soft curve at C(b), hard curve at its kept share, dense as a line); with benchmark
    tables, a second panel: hard accuracy vs measured latency, with ORT's dense fp32 and int8 as references;
    with an auto report (auto.json, experiments/auto_report.py), a last panel: budget=auto's operating points
    beside the fixed budgets, both at the mean latency measured there."""
    pts = sweep["points"]
    whole = SCOPE_SPECS[sweep.get("scope", "attention")].gates_ffn  # sweeps of attention checkpoints name none
    panels = 1 + bool(benches) + bool(auto)
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.5), dpi=120, squeeze=False)
    ax = axes[0][0]
    ax.plot([p["soft_cost"] for p in pts], [100 * p["accuracy_soft"] for p in pts], "o--", color="tab:blue",
            label="soft gates (cost = C(b))", markersize=4)
    hard_label = "hard prefix (cost = kept share of MACs)" if whole else "hard top-k (cost = k / (L·H))"
    ax.plot([p["hard_cost"] for p in pts], [100 * p["accuracy_hard"] for p in pts], "s-", color="tab:red",
            label=hard_label, markersize=4)
    if any("accuracy_hard_int8" in p for p in pts):
        ax.plot([p["hard_cost"] for p in pts], [100 * p["accuracy_hard_int8"] for p in pts], "^:",
                color="tab:green", label=hard_label.split(" (")[0] + ", int8 engine", markersize=4)
    dense = 100 * sweep["dense_accuracy"]
    ax.axhline(dense, color="gray", linestyle=":", label=f"dense model {dense:.1f}%")
    for p in pts:
        if round(p["budget"], 2) in (0.1, 0.25, 0.5, 0.75):
            ax.annotate(f"b={p['budget']:.2f}", (p["hard_cost"], 100 * p["accuracy_hard"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8, color="tab:red")
    ax.set_xlabel("cost (fraction of the gated units' multiply-adds)" if whole
                  else "attention cost (fraction of dense attention heads)")
    ax.set_ylabel(f"accuracy on {sweep['split']} (%)")
    ax.set_xlim(0, 1.02)
    ax.grid(alpha=0.3)
    scope = "whole-model budget" if whole else "attention budget"
    ax.set_title(title or f"{sweep['dataset']}: accuracy vs {scope} (n={sweep['n_examples']})")
    ax.legend(loc="lower right", fontsize=8)
    if benches:
        _latency_panel(axes[0][1], sweep, benches)
    if auto:
        _auto_panel(axes[0][panels - 1], auto)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _latency_panel(ax: Any, sweep: dict[str, Any], benches: list[dict[str, Any]]) -> None:
    """Hard accuracy at each benchmarked budget against its measured latency, one curve per bench table
    (latency_tables: an all-budget file in place of its bench.json; off-grid budgets have no sweep point)."""
    by_budget = {round(p["budget"], 4): p for p in sweep["points"]}
    # The ORT peers run this checkpoint's own weights with every unit: the sweep's ungated accuracy (fp32).
    dense = 100 * sweep.get("ungated_accuracy", sweep["dense_accuracy"])
    colors = iter(("tab:red", "tab:green", "tab:purple", "tab:orange", "tab:brown"))
    for doc in latency_tables(benches):
        precision = str(doc.get("precision", "fp32"))
        column = _HARD_COLUMN.get(precision, "accuracy_hard")
        xy = [(r["latency_ms"], 100 * by_budget[round(r["budget"], 4)][column]) for r in doc["rows"]
              if round(r["budget"], 4) in by_budget and column in by_budget[round(r["budget"], 4)]]
        if not xy:
            continue
        color = next(colors, "black")
        where = "data lengths" if doc.get("seq_len") in (None, "data") else f"{doc['seq_len']} tokens"
        every = ", every budget" if doc.get("mode") == _ALL_BUDGETS else ""
        ax.plot(*zip(*sorted(xy), strict=True), "s-", color=color, markersize=4,
                label=f"this checkpoint, {precision}, {where}{every}")
        peers = doc.get("peers") or {}
        peer = peers.get(_PEER.get(precision, "ort_fp32_ms"))
        if isinstance(peer, int | float):
            ax.plot([peer], [dense], "*", color=color, markersize=11,
                    label=f"ORT, all units, {precision} ({where}; fp32 accuracy)")
    ax.set_xlabel("measured latency, batch 1, one thread (ms)")
    ax.set_ylabel(f"accuracy on {sweep['split']} (%)")
    ax.grid(alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_title("accuracy vs measured latency")
    ax.legend(loc="lower right", fontsize=7)


def _auto_panel(ax: Any, auto: dict[str, Any]) -> None:
    """Accuracy vs measured mean latency: the fixed budgets and each decider's operating points (the default
    one starred)."""
    fixed = sorted(auto["fixed"], key=lambda f: f["mean_latency_ms"])
    ax.plot([f["mean_latency_ms"] for f in fixed], [100 * f["accuracy"] for f in fixed], "s-", color="tab:red",
            markersize=4, label="fixed budgets")
    for color, d in zip(("tab:blue", "tab:orange", "tab:green"), auto["deciders"], strict=False):
        mine = sorted((p for p in auto["points"] if p["decider"] == d["name"]), key=lambda p: p["mean_latency_ms"])
        ax.plot([p["mean_latency_ms"] for p in mine], [100 * p["accuracy"] for p in mine], "o--", color=color,
                markersize=5, label=f"auto: {d['name']}")
        ax.plot([p["mean_latency_ms"] for p in mine if p.get("default")],
                [100 * p["accuracy"] for p in mine if p.get("default")], "*", color=color, markersize=13)
    ax.set_xlabel(f"measured mean latency, batch 1 ({auto['precision']}, {auto['latency_examples']} texts) (ms)")
    ax.set_ylabel(f"accuracy on {auto['split']} (%)")
    ax.grid(alpha=0.3)
    ax.set_title("budget=auto vs fixed budgets (default point starred)")
    ax.legend(loc="lower right", fontsize=8)


def _budgetformer_panels(report: dict[str, Any], fig: Any, axes: Any) -> None:
    """Predicted-budget histogram at auto; accuracy vs mean cost under each cap, dense as a line."""
    h = report["histogram"]
    edges = h["edges"]
    axes[0].bar(edges[:-1], h["counts"], width=edges[1] - edges[0], align="edge", color="tab:purple")
    axes[0].axvline(report["mean_cost"], color="black", linestyle="--", label=f"mean {report['mean_cost']:.2f}")
    axes[0].set(xlabel="predicted budget (fraction of heads run)", ylabel="test inputs",
                title="budget=auto: predicted budgets")
    axes[0].legend()
    caps = report["caps"]
    axes[1].plot([c["mean_cost"] for c in caps], [100 * c["accuracy"] for c in caps], "o-", markersize=4,
                 label="cap = budget grid")
    axes[1].plot([report["mean_cost"]], [100 * report["accuracy"]], "*", markersize=12, color="tab:red",
                 label="auto")
    axes[1].set(xlabel="mean cost (fraction of heads)", ylabel="accuracy (%)", title="accuracy vs mean cost")
    _dense_line(axes[1], report)


def _span_panels(report: dict[str, Any], fig: Any, axes: Any) -> None:
    """Accuracy vs mean span (spans scaled down), dense as a line; the learned spans per layer and head."""
    pts = report["scaled"]
    axes[0].plot([p["mean_span"] for p in pts], [100 * p["accuracy"] for p in pts], "o-", label="test texts")
    if pts and "accuracy_long" in pts[0]:
        axes[0].plot([p["mean_span"] for p in pts], [100 * p["accuracy_long"] for p in pts], "s--",
                     label=f"{report.get('long_length')}-token texts")
        if report.get("dense_accuracy_long") is not None:
            axes[0].axhline(100 * report["dense_accuracy_long"], color="gray", linestyle="--",
                            label="dense, long texts")
    axes[0].set(xlabel="mean span z (tokens; learned spans scaled down)", ylabel="accuracy (%)",
                title="accuracy vs mean span")
    z = np.asarray(report["spans"])
    im = axes[1].imshow(z, aspect="auto", cmap="viridis")
    fig.colorbar(im, ax=axes[1], label="span z (tokens)")
    axes[1].set(xlabel="head", ylabel="layer", title="learned spans")
    _dense_line(axes[0], report)


def _ada_panels(report: dict[str, Any], fig: Any, axes: Any) -> None:
    """Dimensions used per layer; mean complexity scores per layer (dense accuracy in the title: the right
    panel is a score axis, not accuracy)."""
    dense = report.get("dense_accuracy")
    fr = report["dim_fraction_per_layer"]
    axes[0].bar(range(len(fr)), fr, color="tab:orange")
    axes[0].set(xlabel="layer", ylabel="mean fraction of head dimensions used", ylim=(0, 1.05),
                title=f"AdaAttention: {100 * report['full_head_fraction']:.0f}% of heads at full dimension")
    axes[1].bar(range(len(fr)), report["mean_score_per_layer"], color="tab:gray")
    axes[1].axhline(0.5, color="black", linestyle="--", label="threshold")
    acc = f"accuracy {100 * report['accuracy']:.2f}%" + (f" (dense {100 * dense:.2f}%)" if dense else "")
    axes[1].set(xlabel="layer", ylabel="mean complexity score", ylim=(0, 1.05),
                title=f"complexity scores; {acc}")


def _dense_line(ax: Any, report: dict[str, Any]) -> None:
    """The dense model's accuracy as a horizontal line on an accuracy axis, if the report has it."""
    dense = report.get("dense_accuracy")
    if dense is not None:
        ax.axhline(100 * dense, color="gray", linestyle=":", label=f"dense {100 * dense:.1f}%")


# Each adaptive type's two panels, by model_type (tests/training/test_adaptive.py checks these against
# models/model_types.py).
ADAPTIVE_PANELS: dict[str, Callable[[dict[str, Any], Any, Any], None]] = {
    "budgetformer": _budgetformer_panels, "span": _span_panels, "adaattention": _ada_panels}


def adaptive_plot(report: dict[str, Any], path: Path) -> Path:
    """BudgetFormer: predicted-budget histogram and accuracy vs mean cost; span: accuracy vs mean span;
    AdaAttention: dimensions used per layer."""
    panels = ADAPTIVE_PANELS[report["model_type"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    panels(report, fig, axes)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
