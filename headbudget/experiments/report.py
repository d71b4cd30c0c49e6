"""Evaluate a checkpoint on a split: the sweep, the dense reference, the figures; used by train and eval."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headbudget.experiments.plots import load_benches, pareto_plot
from headbudget.models.checkpoint import CheckpointError, load_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.tokenizer import TextEncoder
from headbudget.training.batches import TokenizedSplit, tokenize
from headbudget.training.data import DataError, DataSet, Split, load_data
from headbudget.training.sweep import HardRunner, dense_reference, run_sweep

log = logging.getLogger(__name__)


def align_labels(ds: DataSet, split: Split, model_labels: tuple[str, ...]) -> Split:
    """Re-index a split's labels to the checkpoint's label order, refusing labels the model never saw."""
    unknown = sorted({ds.labels[y] for y in split.labels} - set(model_labels))
    if unknown:
        raise DataError(f"labels in the data that the model does not know: {', '.join(map(repr, unknown[:5]))} "
                        f"(model labels: {', '.join(model_labels)})")
    index = {name: i for i, name in enumerate(model_labels)}
    return Split(split.texts, [index[ds.labels[y]] for y in split.labels])


def checkpoint_split(folder: Path, config: dict[str, Any], labels: tuple[str, ...], max_position: int,
                     data_spec: str, split: str, limit: int | None = None) -> tuple[DataSet, Split, TokenizedSplit]:
    """``split`` of the data, read with the checkpoint's columns and seed, in its label order: raw and tokenized."""
    meta = config.get("data", {})
    ds = load_data(data_spec, meta.get("text_column", "text"), meta.get("label_column", "label"),
                   seed=int(config.get("seed", 7)))
    part = align_labels(ds, ds.split(split).take(limit), labels)
    if not len(part):
        raise DataError(f"split {split!r} of {data_spec} is empty")
    encoder = TextEncoder(folder, int(config.get("max_length", max_position)))
    return ds, part, tokenize(part, encoder)


def evaluate_checkpoint(
    folder: Path, data_spec: str, split: str, out: Path, limit: int | None = None,
    model: BudgetedClassifier | None = None, config: dict[str, Any] | None = None,
    extra_hard: Callable[[TokenizedSplit], dict[str, HardRunner]] | None = None, device: str = "cpu",
) -> dict[str, Any]:
    """Run the 19-budget sweep of a checkpoint on ``split`` and write sweep.json and pareto.png to ``out``."""
    if model is None or config is None:
        model, config = load_checkpoint(folder)
    model = model.to(device)
    ds, _, data = checkpoint_split(folder, config, model.cfg.labels, model.cfg.max_position, data_spec, split, limit)
    dense_acc = None
    dense_dir = folder / "stages" / "dense"
    if (dense_dir / "config.json").is_file():
        try:
            dense_model, _ = load_checkpoint(dense_dir)
            dense_model = dense_model.to(device)
            dense_acc = dense_reference(dense_model, data)
            log.info("dense warm-start model (%s): %.4f", dense_dir, dense_acc)
        except CheckpointError as e:
            log.warning("ignoring the warm-start model: %s", e)
    sweep = run_sweep(model, data, ds.name, split, dense_accuracy=dense_acc,
                      extra_hard=extra_hard(data) if extra_hard else None, progress=log.info)
    sweep["dense_reference"] = "warm-start stage" if dense_acc is not None else "checkpoint with all heads, ungated"
    sweep["truncated_examples"] = data.truncated
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2) + "\n")
    pareto_plot(sweep, out / "pareto.png", benches=load_benches(folder, out))
    return sweep
