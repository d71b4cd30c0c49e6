"""Held-out accuracy of a model run dense, with soft gates, or with the hard mask of a budget."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from headbudget.models.classifier import BudgetedClassifier
from headbudget.training.batches import TokenizedSplit, batches, order_for_eval

Mode = Literal["dense", "soft", "hard"]
# An evaluation batch holds at most this many feed-forward activations (rows x padded tokens x the layer's width):
# past the caches a larger batch costs more per text (docs/decisions.md, 2026-11-29).
EVAL_ACTIVATIONS = 1 << 21


def eval_tokens(model: BudgetedClassifier) -> int:
    """Padded tokens per evaluation batch for ``model`` (``EVAL_ACTIVATIONS``)."""
    return max(1, EVAL_ACTIVATIONS // model.cfg.intermediate_size)


@torch.no_grad()
def predict_logits(
    model: BudgetedClassifier, data: TokenizedSplit, mode: Mode, budget: float = 1.0,
    batch_size: int = 128, device: torch.device | None = None,
) -> np.ndarray:
    """Logits (N, C) in the split's original order."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    gate: torch.Tensor | None = None
    depth: int | None = None  # a hard plan may stop at an exit; soft gates always run every layer
    if mode == "soft":
        gate = model.soft_gates(torch.tensor([budget], device=device))[0]  # (L, H)
    elif mode == "hard":
        gate = model.hard_gates(budget)
        depth = model.hard_depth(budget)
    out = []
    for ids, mask, _ in batches(data, batch_size, device, max_tokens=eval_tokens(model)):
        logits = model(ids, mask, gate) if depth is None else model(ids, mask, gate, depth)
        out.append(logits.float().cpu().numpy())
    model.train(was_training)
    logits = np.concatenate(out) if out else np.zeros((0, model.cfg.n_labels), dtype=np.float32)
    result = np.empty_like(logits)
    result[order_for_eval(data)] = logits
    return result


def accuracy(
    model: BudgetedClassifier, data: TokenizedSplit, mode: Mode, budget: float = 1.0, batch_size: int = 128
) -> float:
    """Fraction of examples whose argmax logit is the label."""
    logits = predict_logits(model, data, mode, budget, batch_size)
    return float((logits.argmax(1) == data.labels).mean()) if len(data) else 0.0


def mean_accuracy(model: BudgetedClassifier, data: TokenizedSplit, mode: Mode, budgets: tuple[float, ...]) -> float:
    """Mean accuracy over several budgets: the checkpoint-selection metric of the gated stages."""
    return float(np.mean([accuracy(model, data, mode, b) for b in budgets]))
