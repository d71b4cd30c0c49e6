"""Aggregate a comparison over seeds (mean +- std) and write compare.json, compare.md and compare.png."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

# Serving every budget: fine-tune jobs (the dense warm start counts as one) and deployed artifacts.
# B = number of budgets; the budgeted run is one job for stages 2 + 3 on top of the warm start.
# The whole-model scope adds the attention-only checkpoint, post-hoc pruning of heads and neuron
# groups, and the dedicated small models (experiments/latency_placement.py writes its report).
ORDER = ("dense", "budgeted", "soft-only", "posthoc", "posthoc-structural", "posthoc+recovery", "static",
         "attention-only", "posthoc-model", "layerdrop", "ffn-half")


def jobs_and_artifacts(method: str, n_budgets: int) -> tuple[int, int]:
    """(fine-tune jobs, deployed artifacts) a method needs to serve all ``n_budgets`` budgets."""
    return {
        "dense": (1, 1),  # serves b = 1 only
        "budgeted": (2, 1),
        "soft-only": (2, 1),
        "posthoc": (1, 1),
        "posthoc-structural": (1, 1),
        "posthoc+recovery": (1 + n_budgets, n_budgets),
        "static": (1 + n_budgets, n_budgets),
        "attention-only": (2, 1),
        "posthoc-model": (1, 1),
        "layerdrop": (2, 1),  # the warm start, then its distillation; serves one point (b = 1), not every budget
        "ffn-half": (2, 1),
    }[method]


def _stats(values: list[float]) -> tuple[float, float]:
    xs = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not xs:
        return float("nan"), float("nan")
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def aggregate(doc: dict[str, Any]) -> dict[str, Any]:
    """Rows (method, budget) with mean and std over seeds, per-method costs, Spearman summaries."""
    seeds = list(doc["per_seed"].values())
    n_b = len(doc["budgets"])
    keys = sorted({k for s in seeds for k in s["results"]},
                  key=lambda k: (ORDER.index(k.split("@")[0]), float(k.split("@")[1])))
    rows = []
    for key in keys:
        per = [s["results"][key] for s in seeds if key in s["results"]]
        dense = [s["results"]["dense@1.00"] for s in seeds if key in s["results"]]
        row: dict[str, Any] = {"method": per[0]["method"], "budget": per[0]["budget"], "n_seeds": len(per)}
        for name, vals in (
            ("accuracy", [p["accuracy"] for p in per]),
            ("cost", [p["cost"] for p in per]),
            ("delta_vs_dense", [p["accuracy"] - d["accuracy"] for p, d in zip(per, dense, strict=True)]),
            ("latency_ms", [p.get("latency_ms") for p in per]),
            ("speedup", [d["latency_ms"] / p["latency_ms"] if p.get("latency_ms") and d.get("latency_ms") else None
                         for p, d in zip(per, dense, strict=True)]),
            ("engine_max_abs_logit_diff", [p.get("engine_max_abs_logit_diff") for p in per]),
            *((("macs_ratio", [p.get("macs_ratio") for p in per]),) if "macs_ratio" in per[0] else ()),
        ):
            row[f"{name}_mean"], row[f"{name}_std"] = _stats(vals)
        rows.append(row)
    methods = {}
    for m in ORDER:
        per_seed_train = []
        for s in seeds:
            own = [r["train_seconds"] for r in s["results"].values() if r["method"] == m]
            if own:
                # per-budget methods train once per budget; the others once for all budgets
                per_seed_train.append(s["dense_train_seconds"] + (sum(own) if m in ("posthoc+recovery", "static")
                                                                 else own[0]))
        if per_seed_train:
            jobs, arts = jobs_and_artifacts(m, n_b)
            mean, std = _stats(per_seed_train)
            methods[m] = {"fine_tune_jobs": jobs, "artifacts": arts, "train_seconds_mean": mean,
                          "train_seconds_std": std}
    names = sorted({k for s in seeds for k in s["spearman"]})
    spearman = {}
    for k in names:
        mean, std = _stats([s["spearman"].get(k) for s in seeds])
        spearman[k] = {"mean": mean, "std": std}
    return {"rows": rows, "methods": methods, "spearman": spearman}


def goal_checks(doc: dict[str, Any]) -> list[str]:
    """The comparison's goals, stated as measured: budgeted vs posthoc (b <= 0.5), vs static and recovery."""
    rows = {(r["method"], round(r["budget"], 4)): r for r in doc["rows"]}
    lines = []
    for b in doc["budgets"]:
        ours = rows.get(("budgeted", round(b, 4)))
        if ours is None:
            continue
        for other, rule in (("posthoc", "beats by > 1 std"), ("static", "within 0.5 points"),
                            ("posthoc+recovery", "within 0.5 points")):
            r = rows.get((other, round(b, 4)))
            if r is None or (other == "posthoc" and b > 0.5):
                continue
            diff = 100 * (ours["accuracy_mean"] - r["accuracy_mean"])
            if other == "posthoc":
                std = 100 * max(ours["accuracy_std"], r["accuracy_std"])
                ok = diff > std
                detail = f"{diff:+.2f} points (larger std {std:.2f})"
            else:
                ok = diff >= -0.5
                detail = f"{diff:+.2f} points"
            lines.append(f"- b = {b:.2f}, budgeted vs {other} ({rule}): {detail} -> {'met' if ok else 'NOT met'}")
    return lines


def _pm(mean: float, std: float, scale: float = 1.0, digits: int = 2) -> str:
    if mean is None or math.isnan(mean):
        return "-"
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def markdown(doc: dict[str, Any]) -> str:
    """compare.md: the headline table, costs to serve all budgets, Spearman figures, goal checks."""
    seeds = ", ".join(str(s) for s in doc["seeds"])
    out = [f"## {doc['dataset']}: method comparison ({doc['base']} base, `{doc['recipe']['name']}` recipe)", "",
           f"Test split, {doc['n_test']} examples; mean ± std over seeds {seeds}. Accuracy and Δ in points; "
           "cost = fraction of attention heads computed (k / (L·H)); latency: "
           + (doc["latency"]["engine"] + f", mean per text over {doc['latency']['texts']} test texts, median of "
              f"{doc['latency']['repeats']} passes; speedup vs the dense model in the same process"
              if doc.get("latency") else "not measured") + ".", "",
           "Methods: `budgeted` is the one budget-conditioned checkpoint (hard top-k); `soft-only` is the same run "
           "before hard adaptation (its stage-2 checkpoint) served with hard masks; `posthoc` is the dense warm "
           "start pruned by gradient importance E|dL/dξ| (`-structural`: at least one head per layer), no "
           "training; `posthoc+recovery` adds one epoch of dense-teacher distillation (T = 2) under the fixed "
           "mask, and `static` trains gates for one fixed budget (soft stage, then hard adaptation): both give "
           "one artifact per budget, evaluated only at that budget.", "",
           "| method | b | cost | accuracy | Δ vs dense | latency ms | speedup |", "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        out.append(f"| {r['method']} | {r['budget']:.2f} | {r['cost_mean']:.3f} | {_pm(r['accuracy_mean'], r['accuracy_std'], 100)} "
                   f"| {_pm(r['delta_vs_dense_mean'], r['delta_vs_dense_std'], 100)} "
                   f"| {_pm(r['latency_ms_mean'], r['latency_ms_std'])} | {_pm(r['speedup_mean'], r['speedup_std'])} |")
    nb = len(doc["budgets"])
    out += ["", f"What each method costs to serve all {nb} budgets (training time includes the shared dense warm "
            "start, mean over seeds):", "", "| method | fine-tune jobs | deployed artifacts | training s |",
            "|---|---|---|---|"]
    for m, v in doc["methods"].items():
        out.append(f"| {m} | {v['fine_tune_jobs']} | {v['artifacts']} | {_pm(v['train_seconds_mean'], v['train_seconds_std'], 1, 0)} |")
    out += ["", *spearman_lines(doc)]
    checks = goal_checks(doc)
    if checks:
        out += ["", "What the budgeted checkpoint must meet:", "", *checks]
    out += ["", f"Trained in this invocation: {', '.join(doc['trained_this_run']) or 'nothing (all cached)'}; "
            f"wall time {doc['wall_seconds']:.0f} s.", ""]
    return "\n".join(out)


def spearman_lines(doc: dict[str, Any], units: str = "heads") -> list[str]:
    """The rank-agreement paragraph and its list of figures."""
    out = [f"Rank agreement of {units} (Spearman, mean ± std over seeds). The budgeted checkpoint serves one "
           "ranking, by crossing budget b* = sigmoid(-a/β), so its kept sets are nested and its serving ranking "
           "is identical at every budget (Spearman 1 by construction); the published figure (0.91 on AG News) "
           "compares the gate values g(0.25) and g(0.75), reported here as sweep.py's `gate_spearman` does:", ""]
    labels = {"budgeted_g_025_075": "budgeted, g(0.25) vs g(0.75)",
              "budgeted_vs_importance": "budgeted ranking vs gradient importance of the dense model",
              "static_025_vs_075": "static b = 0.25 vs static b = 0.75 rankings (separately trained)"}
    for k, v in doc["spearman"].items():
        out.append(f"- {labels.get(k, k)}: {_pm(v['mean'], v['std'], 1, 3)}")
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """Accuracy vs cost, one series per method, error bars = std over seeds; dense as a reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    styles = {"budgeted": "s-", "soft-only": "v--", "posthoc": "o:", "posthoc-structural": "D:",
              "posthoc+recovery": "^-.", "static": "P-"}
    for m, style in styles.items():
        rs = [r for r in doc["rows"] if r["method"] == m]
        if rs:
            ax.errorbar([r["cost_mean"] for r in rs], [100 * r["accuracy_mean"] for r in rs],
                        yerr=[100 * r["accuracy_std"] for r in rs], fmt=style, capsize=3, markersize=5, label=m)
    dense = [r for r in doc["rows"] if r["method"] == "dense"]
    if dense:
        d = dense[0]
        ax.axhline(100 * d["accuracy_mean"], color="gray", linestyle=":", label=f"dense {100 * d['accuracy_mean']:.1f}%")
    ax.set_xlabel("attention cost (fraction of heads computed)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_xlim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.set_title(f"{doc['dataset']}: accuracy vs cost, mean ± std over seeds {doc['seeds']}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _no_nan(x: Any) -> Any:
    """NaN (a figure that could not be computed) as null, so that compare.json is strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_no_nan(v) for v in x]
    return x


def write_json(doc: dict[str, Any], out: Path) -> None:
    """compare.json, a figure that could not be computed as null."""
    (out / "compare.json").write_text(json.dumps(_no_nan(doc), indent=2, allow_nan=False) + "\n")


def write_report(doc: dict[str, Any], out: Path) -> None:
    """Add the aggregate to ``doc`` and write the three files (the whole-model scope's: latency_placement.py's)."""
    doc.update(aggregate(doc))
    write_json(doc, out)
    (out / "compare.md").write_text(markdown(doc))
    plot(doc, out / "compare.png")
