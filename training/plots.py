"""Figures: accuracy vs attention cost (pareto.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def pareto_plot(sweep: dict[str, Any], path: Path, title: str | None = None) -> Path:
    """Accuracy vs cost: soft curve at soft cost, hard curve at k/(L*H), dense as a reference line."""
    pts = sweep["points"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot([p["soft_cost"] for p in pts], [100 * p["accuracy_soft"] for p in pts], "o--", color="tab:blue",
            label="soft gates (cost = C(b))", markersize=4)
    ax.plot([p["hard_cost"] for p in pts], [100 * p["accuracy_hard"] for p in pts], "s-", color="tab:red",
            label="hard top-k (cost = k / (L·H))", markersize=4)
    if any("accuracy_hard_int8" in p for p in pts):
        ax.plot([p["hard_cost"] for p in pts], [100 * p["accuracy_hard_int8"] for p in pts], "^:",
                color="tab:green", label="hard top-k, int8 engine", markersize=4)
    ax.axhline(100 * sweep["dense_accuracy"], color="gray", linestyle=":",
               label=f"dense model {100 * sweep['dense_accuracy']:.1f}%")
    for p in pts:
        if round(p["budget"], 2) in (0.1, 0.25, 0.5, 0.75):
            ax.annotate(f"b={p['budget']:.2f}", (p["hard_cost"], 100 * p["accuracy_hard"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8, color="tab:red")
    ax.set_xlabel("attention cost (fraction of dense attention heads)")
    ax.set_ylabel(f"accuracy on {sweep['split']} (%)")
    ax.set_xlim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title or f"{sweep['dataset']}: accuracy vs attention budget (n={sweep['n_examples']})")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
