"""Sweep documents of test checkpoints, as run_sweep writes them, without evaluating accuracy."""

from __future__ import annotations

from typing import Any

from headbudget.models.budget import BUDGET_GRID
from headbudget.models.classifier import BudgetedClassifier
from lab import standin


def plan_sweep(model: BudgetedClassifier, record_exits: bool = True, n_examples: int = 400) -> dict[str, Any]:
    """``model``'s sweep on the synthetic task: its plans at every budget, made-up hard accuracies rising with b."""
    cfg, policy = model.cfg, model.gates.policy()
    doc: dict[str, Any] = {
        "dataset": "synthetic", "split": "test", "n_examples": n_examples, "dense_accuracy": 0.9,
        "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "structural": cfg.gate.structural,
        "head_order": model.gates.order().tolist(),
        "points": [{"budget": b, **standin.plan_record(policy.plan(b)), "accuracy_hard": 0.5 + 0.4 * b}
                   for b in BUDGET_GRID],
    }
    if cfg.gate.scope == "model":
        doc.update(scope="model", ffn_group=cfg.gate.ffn_group, ref_length=cfg.gate.ref_length)
        if record_exits:
            doc["exits"] = list(cfg.gate.exits)
    return doc
