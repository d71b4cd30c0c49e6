"""Held-out evaluation of the adaptive model types: accuracy and what each input actually used.

BudgetFormer: accuracy and mean heads at `auto` and under every budget cap of the grid, and the distribution
of predicted budgets. Span: accuracy at the learned spans and with spans scaled down (accuracy vs mean span),
on the split and on long texts made by concatenating same-label texts to 512 tokens. AdaAttention: accuracy,
the share of heads kept at full dimension and the dimensions used.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headbudget.experiments.report import checkpoint_split
from headbudget.models.adaptive import AdaptiveClassifier
from headbudget.models.budget import BUDGET_GRID
from headbudget.models.checkpoint import CheckpointError, load_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.span import SpanClassifier, span_window
from headbudget.models.tokenizer import TextEncoder
from headbudget.training.batches import TokenizedSplit, batches, order_for_eval, tokenize
from headbudget.training.data import DataError, Split
from headbudget.training.evaluation import accuracy

log = logging.getLogger(__name__)

LONG_LENGTH = 512
SPAN_SCALES = (0.25, 0.5, 0.75, 1.0)


@torch.no_grad()
def run_with_usage(model: AdaptiveClassifier, data: TokenizedSplit, batch_size: int = 64, cap: float = 1.0
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Logits (N, C) and per-input usage (name -> (N, L, ...)) in the split's original order, each input's
    choice bounded by ``cap`` (1.0: the model's own)."""
    device = next(model.parameters()).device
    model.eval()
    logits, usage = [], {}  # type: ignore[var-annotated]
    for ids, mask, _ in batches(data, batch_size, device):
        out = model.forward_adaptive(ids, mask, cap=cap)
        logits.append(out.logits.float().cpu().numpy())
        for k, v in out.usage.items():
            usage.setdefault(k, []).append(v.float().cpu().numpy())
    order = order_for_eval(data)
    out = np.empty((len(data), model.cfg.n_labels), dtype=np.float32)
    out[order] = np.concatenate(logits)
    stats = {}
    for k, parts in usage.items():
        cat = np.concatenate(parts)
        stats[k] = np.empty_like(cat)
        stats[k][order] = cat
    return out, stats


def long_texts(split: Split, encoder: TextEncoder, length: int = LONG_LENGTH) -> Split:
    """Same-label texts joined in order until each joined text has at least ``length`` tokens (label kept)."""
    texts, labels = [], []
    by_label: dict[int, list[str]] = {}
    for text, label in zip(split.texts, split.labels, strict=True):
        by_label.setdefault(label, []).append(text)
    for label in sorted(by_label):
        parts: list[str] = []
        for text in by_label[label]:
            parts.append(text)
            if len(encoder.tokenizer.encode(" ".join(parts)).ids) >= length:
                texts.append(" ".join(parts))
                labels.append(label)
                parts = []
    return Split(texts, labels)


def _acc(logits: np.ndarray, data: TokenizedSplit) -> float:
    return float((logits.argmax(1) == data.labels).mean()) if len(data) else 0.0


def budgetformer_report(model: AdaptiveClassifier, data: TokenizedSplit) -> dict[str, Any]:
    """Accuracy and heads at auto and under each cap; predicted budgets per input at auto."""
    total = model.cfg.total_heads
    caps = []
    for b in BUDGET_GRID:
        logits, usage = run_with_usage(model, data, cap=b)
        heads = usage["heads"].sum(1)  # (N,)
        caps.append({"budget": b, "accuracy": _acc(logits, data), "mean_cost": float(heads.mean() / total),
                     "max_cost": float(heads.max() / total)})
    logits, usage = run_with_usage(model, data)
    predicted = usage["heads"].sum(1) / total  # (N,) fraction of heads each input ran
    hist, edges = np.histogram(predicted, bins=np.linspace(0.0, 1.0, 21))
    return {
        "accuracy": _acc(logits, data), "mean_cost": float(predicted.mean()),
        "cost_percentiles": {str(q): float(np.percentile(predicted, q)) for q in (5, 25, 50, 75, 95)},
        "heads_per_layer_mean": usage["heads"].mean(0).tolist(), "s_per_layer_mean": usage["s"].mean(0).tolist(),
        "histogram": {"edges": edges.tolist(), "counts": hist.tolist()}, "predicted_budgets": predicted.tolist(),
        "caps": caps,
    }


def span_report(model: SpanClassifier, data: TokenizedSplit, long: TokenizedSplit | None) -> dict[str, Any]:
    """Accuracy at the learned spans, and with every span scaled by each of SPAN_SCALES, on both sets."""
    layers = model.span_layers()
    learned = [a.span_ratio.detach().clone() for a in layers]
    ramp = model.cfg.span.ramp
    points = []
    try:
        for scale in SPAN_SCALES:
            for a, r in zip(layers, learned, strict=True):
                a.span_ratio.data.copy_(r * scale)
            z = np.array([[float(v) for v in a.spans().detach()] for a in layers])
            point = {"scale": scale, "mean_span": float(z.mean()),
                     "mean_window": float(np.mean([[span_window(v, ramp) for v in row] for row in z])),
                     "accuracy": accuracy(model, data, "dense")}
            if long is not None and len(long):
                point["accuracy_long"] = accuracy(model, long, "dense", batch_size=16)
            points.append(point)
    finally:
        for a, r in zip(layers, learned, strict=True):
            a.span_ratio.data.copy_(r)
    spans = [[float(v) for v in a.spans().detach()] for a in layers]
    return {"accuracy": points[-1]["accuracy"], "accuracy_long": points[-1].get("accuracy_long"),
            "spans": spans, "windows": model.windows(), "mean_span": float(np.mean(spans)), "ramp": ramp,
            "scaled": points}


def ada_report(model: AdaptiveClassifier, data: TokenizedSplit) -> dict[str, Any]:
    """Accuracy, the share of heads at full dimension, and the mean fraction of head dimensions used."""
    logits, usage = run_with_usage(model, data)
    dims = usage["dims"]  # (N, L, H)
    head_dim = model.cfg.head_dim
    return {"accuracy": _acc(logits, data), "full_head_fraction": float((dims == head_dim).mean()),
            "mean_dim_fraction": float(dims.mean() / head_dim),
            "dim_fraction_per_layer": (dims.mean(axis=(0, 2)) / head_dim).tolist(),
            "mean_score_per_layer": usage["score"].mean(axis=(0, 2)).tolist()}


@dataclass(frozen=True)
class ReportInputs:
    """What a type's report may need beyond the model and the split's tokens."""

    folder: Path  # the checkpoint (its tokenizer)
    part: Split  # the split's texts
    dense: BudgetedClassifier | None  # the dense warm-start stage, if the checkpoint has one
    long_length: int  # tokens of the long texts the span report makes


def _budgetformer_entry(model: AdaptiveClassifier, data: TokenizedSplit, inputs: ReportInputs) -> dict[str, Any]:
    return budgetformer_report(model, data)


def _span_entry(model: AdaptiveClassifier, data: TokenizedSplit, inputs: ReportInputs) -> dict[str, Any]:
    """span_report on the split and on long texts made from it, with the dense model's long-text accuracy."""
    assert isinstance(model, SpanClassifier)
    long_encoder = TextEncoder(inputs.folder, min(inputs.long_length, model.cfg.max_position))
    long = tokenize(long_texts(inputs.part, long_encoder, inputs.long_length), long_encoder)
    entry = span_report(model, data, long)
    entry["long_examples"] = len(long)
    entry["long_length"] = inputs.long_length
    if inputs.dense is not None and len(long):
        entry["dense_accuracy_long"] = accuracy(inputs.dense, long, "dense", batch_size=16)
    return entry


def _ada_entry(model: AdaptiveClassifier, data: TokenizedSplit, inputs: ReportInputs) -> dict[str, Any]:
    return ada_report(model, data)


# Each adaptive type's report, by model_type (tests/training/test_adaptive.py checks these against
# models/model_types.py).
REPORTS: dict[str, Callable[[AdaptiveClassifier, TokenizedSplit, ReportInputs], dict[str, Any]]] = {
    "budgetformer": _budgetformer_entry, "span": _span_entry, "adaattention": _ada_entry}


def evaluate_adaptive(folder: Path, data_spec: str, split: str, out: Path, limit: int | None = None,
                      device: str = "cpu", long_length: int = LONG_LENGTH) -> dict[str, Any]:
    """Evaluate an adaptive checkpoint on ``split``; writes adaptive_sweep.json (and figures) to ``out``."""
    model, config = load_checkpoint(folder)
    if not isinstance(model, AdaptiveClassifier) or model.cfg.model_type not in REPORTS:
        raise DataError(f"{folder}: model_type {model.cfg.model_type!r} is not an adaptive type")
    type_report = REPORTS[model.cfg.model_type]
    model = model.to(device).eval()
    ds, part, data = checkpoint_split(folder, config, model.cfg.labels, model.cfg.max_position, data_spec, split, limit)
    report: dict[str, Any] = {"model_type": model.cfg.model_type, "dataset": ds.name, "split": split,
                              "n_examples": len(data), "checkpoint": str(folder)}
    dense = None
    try:
        dense, _ = load_checkpoint(folder / "stages" / "dense")
        dense = dense.to(device)
        report["dense_accuracy"] = accuracy(dense, data, "dense")
    except CheckpointError:
        log.warning("%s: no dense warm-start stage to compare with", folder)
    report.update(type_report(model, data, ReportInputs(folder, part, dense, long_length)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "adaptive_sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    from headbudget.experiments.plots import adaptive_plot

    adaptive_plot(report, out / "adaptive.png")
    return report
