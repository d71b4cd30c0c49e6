"""The whole-model comparison placed by measured latency: compare.md and compare.png for ``--scope model``.

The question is "at equal measured latency, which is more accurate": for each dedicated small model (one point)
and for each budget of the attention-only checkpoint, the budgeted checkpoint's accuracy at that point's latency,
read off its own accuracy-against-latency curve. Per seed (latencies are paired: measured in one process,
round-robin), the curve's points are ordered by measured latency and the accuracy is interpolated linearly in
latency between the two adjacent points whose latencies bracket the target; a target outside the measured
range is "not reached" (no extrapolation). Differences are budgeted minus the other method, then mean and std
over the seeds that reach it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from headbudget.experiments.compare.report import _pm, _stats, aggregate, spearman_lines, write_json

SMALL = ("layerdrop", "ffn-half")
TARGETS = (*SMALL, "attention-only")
TOLERANCE = 0.005  # the 0.5 points: the budgeted checkpoint may trail a dedicated small model by this much

Point = tuple[float, float, float]  # (budget, latency ms, accuracy)


def at_latency(curve: list[Point], latency: float) -> dict[str, Any] | None:
    """The curve's accuracy at ``latency`` and the two budgets that bracket it; None outside the measured range."""
    pts = sorted(curve, key=lambda p: (p[1], p[0]))
    for lo, hi in zip(pts, pts[1:], strict=False):
        if lo[1] <= latency <= hi[1]:
            w = (latency - lo[1]) / (hi[1] - lo[1]) if hi[1] > lo[1] else 0.0
            return {"accuracy": lo[2] + w * (hi[2] - lo[2]), "bracket_budgets": [lo[0], hi[0]],
                    "bracket_latency_ms": [lo[1], hi[1]]}
    exact = [p for p in pts if p[1] == latency]  # a one-point curve
    if exact:
        return {"accuracy": exact[0][2], "bracket_budgets": [exact[0][0]] * 2, "bracket_latency_ms": [latency] * 2}
    return None


def seed_placement(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One seed's results -> every target's latency, accuracy, the budgeted accuracy there and the difference."""
    curve = [(r["budget"], r["latency_ms"], r["accuracy"]) for r in results.values()
             if r["method"] == "budgeted" and r.get("latency_ms")]
    rows = []
    for r in results.values():
        if r["method"] not in TARGETS or not r.get("latency_ms"):
            continue
        hit = at_latency(curve, r["latency_ms"])
        rows.append({"method": r["method"], "budget": r["budget"], "latency_ms": r["latency_ms"],
                     "accuracy": r["accuracy"], "budgeted_accuracy": hit["accuracy"] if hit else None,
                     "difference": hit["accuracy"] - r["accuracy"] if hit else None,
                     "bracket_budgets": hit["bracket_budgets"] if hit else None,
                     "bracket_latency_ms": hit["bracket_latency_ms"] if hit else None})
    return rows


def placement(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target, aggregated over seeds, with the issue's rule and whether the mean difference meets it."""
    by_key: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for seed, s in doc["per_seed"].items():
        for row in seed_placement(s["results"]):
            by_key.setdefault((row["method"], row["budget"]), {})[seed] = row
    out = []
    for (method, budget), per in sorted(by_key.items(), key=lambda kv: (TARGETS.index(kv[0][0]), kv[0][1])):
        reached = [r for r in per.values() if r["difference"] is not None]
        row: dict[str, Any] = {"method": method, "budget": budget, "n_seeds": len(per), "n_reached": len(reached)}
        for name, vals in (("latency_ms", [r["latency_ms"] for r in per.values()]),
                           ("accuracy", [r["accuracy"] for r in per.values()]),
                           ("budgeted_accuracy", [r["budgeted_accuracy"] for r in reached]),
                           ("difference", [r["difference"] for r in reached])):
            row[f"{name}_mean"], row[f"{name}_std"] = _stats(vals)
        small = method in SMALL
        row["rule"] = f"difference >= -{TOLERANCE} ({100 * TOLERANCE:.1f} points)" if small else "difference > 0"
        diff = row["difference_mean"]
        row["met"] = None if not reached else bool(diff >= -TOLERANCE if small else diff > 0)
        row["per_seed"] = per
        out.append(row)
    return out


def _brackets(row: dict[str, Any]) -> str:
    got = sorted({tuple(sorted(r["bracket_budgets"])) for r in row["per_seed"].values() if r["bracket_budgets"]})
    return ", ".join(f"{lo:.2f}–{hi:.2f}" for lo, hi in got) or "-"


def _shape(doc: dict[str, Any], method: str) -> str:
    """What a small model is, read from its rows: 'first 3 layers', 'feed-forward width 768'."""
    for s in doc["per_seed"].values():
        for r in s["results"].values():
            if r["method"] == method and "n_layers" in r:
                if method == "ffn-half":
                    return f"feed-forward width {r['intermediate_size']}"
                return f"first {r['n_layers']} layer{'s' if r['n_layers'] > 1 else ''}"
    return method


def _rows_by_latency(doc: dict[str, Any], lat: dict[str, Any] | None) -> list[str]:
    """The methods' table, sorted by measured latency (by MACs when latency was not measured)."""
    out: list[str] = []
    key = "latency_ms_mean" if lat else "macs_ratio_mean"
    for r in sorted(doc["rows"], key=lambda r: (r.get(key) if r.get(key) == r.get(key) else float("inf"),
                                                r["method"], r["budget"])):
        out.append(f"| {r['method']} | {r['budget']:.2f} | {_pm(r['latency_ms_mean'], r['latency_ms_std'])} "
                   f"| {_pm(r['speedup_mean'], r['speedup_std'])} | {_pm(r['macs_ratio_mean'], r['macs_ratio_std'], 1, 3)} "
                   f"| {r['cost_mean']:.3f} | {_pm(r['accuracy_mean'], r['accuracy_std'], 100)} "
                   f"| {_pm(r['delta_vs_dense_mean'], r['delta_vs_dense_std'], 100)} |")
    return out


def _placement_lines(doc: dict[str, Any]) -> list[str]:
    """The budgeted curve at each other method's measured latency, and what it must meet there."""
    out = ["", "### At equal measured latency", ""]
    if not doc.get("placement"):
        out.append("Latency was not measured, so no method could be placed.")
    else:
        out += ["The budgeted checkpoint's accuracy at each point's latency, interpolated linearly in latency between "
                "the two budgets whose measured latencies bracket it (per seed; no extrapolation), and the "
                "difference, budgeted minus the other method, in points:", "",
                "| method | b | latency ms | accuracy | budgeted there | difference | bracketing budgets | seeds reached |",
                "|---|---|---|---|---|---|---|---|"]
        for p in doc["placement"]:
            out.append(f"| {p['method']} | {p['budget']:.2f} | {_pm(p['latency_ms_mean'], p['latency_ms_std'])} "
                       f"| {_pm(p['accuracy_mean'], p['accuracy_std'], 100)} "
                       f"| {_pm(p['budgeted_accuracy_mean'], p['budgeted_accuracy_std'], 100)} "
                       f"| {_pm(p['difference_mean'], p['difference_std'], 100)} | {_brackets(p)} "
                       f"| {p['n_reached']} of {p['n_seeds']} |")
        out += ["", "What the budgeted checkpoint must meet (at equal measured latency):", ""]
        for p in doc["placement"]:
            what = p["method"] if p["method"] in SMALL else f"attention-only b = {p['budget']:.2f}"
            verdict = ("not reached by the budgeted curve" if p["met"] is None else
                       f"{100 * p['difference_mean']:+.2f} points -> {'met' if p['met'] else 'NOT met'}")
            out.append(f"- budgeted vs {what} ({p['rule']}): {verdict}")
    return out


def _cost_lines(doc: dict[str, Any]) -> list[str]:
    """What each method costs to train and to deploy."""
    nb = len(doc["budgets"])
    out = ["", f"What each method costs (training time includes the shared dense warm start, mean over seeds); the "
            f"budgeted types serve all {nb} budgets, the small models one point each:", "",
            "| method | fine-tune jobs | deployed artifacts | training s |", "|---|---|---|---|"]
    for m, v in doc["methods"].items():
        out.append(f"| {m} | {v['fine_tune_jobs']} | {v['artifacts']} | {_pm(v['train_seconds_mean'], v['train_seconds_std'], 1, 0)} |")
    return out


def markdown(doc: dict[str, Any]) -> str:
    """compare.md for the whole-model scope: methods by latency, the budgeted curve at each baseline's latency."""
    seeds = ", ".join(str(s) for s in doc["seeds"])
    lat = doc.get("latency")
    out = [f"## {doc['dataset']}: the whole-model budget against its baselines, by measured latency ({doc['base']} "
           f"base, `{doc['recipe']['name']}` recipe)", "",
           f"Test split, {doc['n_test']} examples; mean ± std over seeds {seeds}. Accuracy and Δ in points; MACs = "
           "whole-forward multiply-adds at 128 tokens as a fraction of the dense model's; cost = the budget's own "
           "unit (model scope: share of head and feed-forward MACs; attention-only: fraction of heads); latency: "
           + (f"{lat['engine']}, mean per text over {lat['texts']} test texts, median of {lat['repeats']} passes, "
              "every artifact in one process, round-robin; speedup vs the dense model" if lat else "not measured")
           + ".", "",
           "Methods: `budgeted` is the one checkpoint whose budget spans attention heads and feed-forward neuron "
           "groups (`--scope model`, also served at b = 1); `soft-only` is its stage-2 checkpoint under hard masks; "
           "`attention-only` is the attention-scope checkpoint of the same seed (the published method); "
           "`posthoc-model` is the dense warm start with heads and neuron groups ranked by gradient importance "
           f"E|dL/dξ|, no training; `layerdrop` ({_shape(doc, 'layerdrop')}) and `ffn-half` "
           f"({_shape(doc, 'ffn-half')}, kept by importance) are the dedicated small models a user would train "
           "instead, cut from the dense model and distilled from it (one epoch, T = 2): one artifact, one point each.",
           "", "Sorted by " + ("measured latency:" if lat else "MACs (latency not measured):"), "",
           "| method | b | latency ms | speedup | MACs | cost | accuracy | Δ vs dense |", "|---|---|---|---|---|---|---|---|"]
    out += _rows_by_latency(doc, lat) + _placement_lines(doc) + _cost_lines(doc)
    out += ["", *spearman_lines(doc, units="units (heads and feed-forward groups)")]
    out += ["", f"Trained in this invocation: {', '.join(doc['trained_this_run']) or 'nothing (all cached)'}; "
            f"wall time {doc['wall_seconds']:.0f} s.", ""]
    return "\n".join(out)


STYLES = {"budgeted": "s-", "soft-only": "v--", "attention-only": "o-", "posthoc-model": "D:"}
MARKERS = {"dense": ("*", "black"), "layerdrop": ("X", "tab:red"), "ffn-half": ("P", "tab:purple")}


def plot(doc: dict[str, Any], path: Path) -> None:
    """Accuracy against MACs and, when measured, against latency; small models and dense as single points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_spec = [("macs_ratio", "whole-forward MACs (fraction of dense, 128 tokens)")]
    if doc.get("latency"):
        axes_spec.append(("latency_ms", f"measured latency, ms per text ({doc['latency']['engine']})"))
    fig, axes = plt.subplots(1, len(axes_spec), figsize=(6.5 * len(axes_spec), 4.8), dpi=120, squeeze=False)
    for ax, (field, label) in zip(axes[0], axes_spec, strict=True):
        for m, style in STYLES.items():
            rs = sorted((r for r in doc["rows"] if r["method"] == m), key=lambda r: r["budget"])
            if rs:
                ax.errorbar([r[f"{field}_mean"] for r in rs], [100 * r["accuracy_mean"] for r in rs],
                            xerr=[r[f"{field}_std"] for r in rs], yerr=[100 * r["accuracy_std"] for r in rs],
                            fmt=style, capsize=3, markersize=5, label=m)
        for m, (marker, color) in MARKERS.items():
            for r in (r for r in doc["rows"] if r["method"] == m):
                ax.errorbar([r[f"{field}_mean"]], [100 * r["accuracy_mean"]], xerr=[r[f"{field}_std"]],
                            yerr=[100 * r["accuracy_std"]], fmt=marker, color=color, markersize=10, capsize=3,
                            label=m if m == "dense" else f"{m} ({_shape(doc, m)})")
        ax.set_xlabel(label, fontsize=8)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{doc['dataset']}: whole-model budget vs baselines, mean ± std over seeds {doc['seeds']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(doc: dict[str, Any], out: Path) -> None:
    """Add the aggregate and the placement to ``doc`` and write compare.json, compare.md and compare.png."""
    doc.update(aggregate(doc))
    doc["placement"] = placement(doc)
    write_json(doc, out)
    (out / "compare.md").write_text(markdown(doc))
    plot(doc, out / "compare.png")
