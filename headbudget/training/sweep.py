"""The 19-budget sweep of the evaluation protocol: costs, soft and hard accuracy, nestedness, Spearman."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr

from headbudget.models.budget import BUDGET_GRID, GateParams, soft_gates
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import ModelConfig
from headbudget.models.plan import BudgetPolicy, Shape, soft_cost_weights
from headbudget.training.batches import TokenizedSplit
from headbudget.training.evaluation import accuracy

# Optional extra hard-accuracy columns (e.g. the engine's int8 path): name -> (budget -> accuracy).
HardRunner = Callable[[float], float]


def masks_nested(masks: list[np.ndarray]) -> bool:
    """True when every mask (in increasing budget order) is a subset of the next."""
    return all(bool(np.all(a <= b)) for a, b in zip(masks, masks[1:], strict=False))


def gate_spearman(model: BudgetedClassifier, b1: float = 0.25, b2: float = 0.75) -> float:
    """Spearman correlation of the soft gate values g(b1) and g(b2) over all heads."""
    p, g = model.gates.params(), model.cfg.gate
    x = soft_gates(p, b1, g.tau, g.eps).ravel()
    y = soft_gates(p, b2, g.tau, g.eps).ravel()
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)


def _cost_point(cfg: ModelConfig, params: GateParams, policy: BudgetPolicy, weights: np.ndarray | None,
                mask: np.ndarray, b: float) -> dict[str, Any]:
    """What budget ``b`` keeps, and what it costs, soft and hard (the sweep's point before its accuracies)."""
    gcfg = cfg.gate
    heads = mask[:, : cfg.n_heads]
    soft = soft_gates(params, b, gcfg.tau, gcfg.eps)
    point: dict[str, Any] = {
        "budget": b,
        "soft_cost": float(soft.mean() if weights is None else (soft * weights).sum()),
        "hard_cost": policy.hard_cost(b),
        "heads_active": int(heads.sum()),
        "heads_total": cfg.total_heads,
        "heads_per_layer": heads.sum(1).astype(int).tolist(),
    }
    if gcfg.scope_spec.gates_ffn:
        plan = policy.plan(b)
        assert plan.ffn is not None
        point.update({
            "neurons_active": sum(plan.ffn), "neurons_total": cfg.n_layers * cfg.intermediate_size,
            "neurons_per_layer": list(plan.ffn),
            # The whole forward pass's share at the reference length (hard_cost leaves out the classifier).
            "macs_fraction": plan.cost(Shape.of(cfg), gcfg.ref_length).ratio,
            "layers_run": plan.layers_run,
        })
    return point


def run_sweep(
    model: BudgetedClassifier, data: TokenizedSplit, dataset: str, split: str,
    dense_accuracy: float | None = None, budgets: tuple[float, ...] = BUDGET_GRID,
    extra_hard: dict[str, HardRunner] | None = None, progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Evaluate every budget; returns the sweep.json document."""
    cfg, gcfg = model.cfg, model.cfg.gate
    params, policy, weights = model.gates.params(), model.gates.policy(), soft_cost_weights(cfg)
    points, masks = [], []
    for b in budgets:
        mask = policy.mask(b)  # (L, U)
        masks.append(mask)
        point = _cost_point(cfg, params, policy, weights, mask, b)
        point["accuracy_soft"] = accuracy(model, data, "soft", b)
        point["accuracy_hard"] = accuracy(model, data, "hard", b)
        for name, runner in (extra_hard or {}).items():
            point[name] = runner(b)
        points.append(point)
        if progress:
            progress(f"b={b:.2f} heads={point['heads_active']}/{cfg.total_heads} "
                     f"soft={point['accuracy_soft']:.4f} hard={point['accuracy_hard']:.4f}")
    ungated = accuracy(model, data, "dense")
    soft_costs = [p["soft_cost"] for p in points]
    return {
        "dataset": dataset,
        "split": split,
        "n_examples": len(data),
        "dense_accuracy": ungated if dense_accuracy is None else dense_accuracy,
        "ungated_accuracy": ungated,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "structural": gcfg.structural,
        **({"scope": gcfg.scope, "ffn_group": gcfg.ffn_group, "ref_length": gcfg.ref_length, "exits": list(gcfg.exits)}
           if gcfg.scope_spec.gates_ffn else {}),
        "points": points,
        "spearman_025_075": gate_spearman(model),
        "nested": masks_nested(masks),
        "soft_cost_monotone": all(a <= b + 1e-12 for a, b in zip(soft_costs, soft_costs[1:], strict=False)),
        "head_order": model.gates.order().tolist(),
    }


@torch.no_grad()
def dense_reference(model: BudgetedClassifier, data: TokenizedSplit) -> float:
    """Accuracy of a dense (gates off) model: the warm-start reference line."""
    return accuracy(model, data, "dense")
