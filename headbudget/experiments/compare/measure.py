"""What `headbudget compare` measures besides accuracy: latency (round-robin, one process), multiply-adds, and
the rank agreement of head (or unit) rankings."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import ModelConfig
from headbudget.models.plan import Shape, uniform_plan
from headbudget.training.batches import TokenizedSplit

if TYPE_CHECKING:
    from headbudget.experiments.compare.run import CompareConfig, SeedContext

# A latency probe: artifact folder -> predict(ids (1, N) int64, mask (1, N), budget) -> logits (1, C).
Predictor = Callable[[np.ndarray, np.ndarray, float], np.ndarray]
EngineFactory = Callable[[Path], Predictor]


def engine_factory(backend: str, budgets: tuple[float, ...]) -> EngineFactory:
    """The serving engine (fp32, one thread) of an artifact, as ids, mask, budget -> logits.

    Every compared budget is asked for as prepacked (``EngineOptions.prepacked_budgets``), as a budget that is
    an operating point is served (a tier's default). Where the all-budget graph has no packed levels, ORT
    packs a partial layer's slices on every call: the kept AG News checkpoint's b = 0.75 measured 6.19 ms
    against 5.19 ms prepacked (150 texts, one process), which would place every method against a curve slower
    than what a user running that budget gets. With feed-forward levels the engine serves them from the
    all-budget session (engine/onnx/backend.py). Every artifact gets the same options.
    """
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions

    options = EngineOptions(backend=backend, precision="fp32", threads=1, prepacked_budgets=budgets)  # type: ignore[arg-type]

    def factory(folder: Path) -> Predictor:
        return load_engine(folder, options).predict_ids

    return factory


def macs_ratio(model: BudgetedClassifier, budget: float | None, dense: ModelConfig) -> float:
    """Whole-forward multiply-adds of ``model`` at ``budget`` (None: every unit), at the reference length, over
    the dense model's: comparable across the budgeted checkpoints and the smaller dedicated models."""
    n = dense.gate.ref_length
    own = uniform_plan(model.cfg, model.cfg.n_heads) if budget is None else model.gates.policy().plan(budget)
    full = uniform_plan(dense, dense.n_heads).cost(Shape.of(dense), n).total_macs
    return own.cost(Shape.of(model.cfg), n).total_macs / full


def measure_latency(entries: list[tuple[str, float, Path]], test: TokenizedSplit, factory: EngineFactory,
                    n_texts: int, repeats: int) -> dict[tuple[str, float], dict[str, float]]:
    """Median (over passes) mean per-text latency, batch 1, of every entry, timed round-robin in one process."""
    texts = [np.asarray([ids], dtype=np.int64) for ids in test.ids[:n_texts]]
    inputs = [(ids, np.ones_like(ids, dtype=np.int32)) for ids in texts]
    predictors: dict[Path, Predictor] = {}
    for _, _, folder in entries:
        if folder not in predictors:
            predictors[folder] = factory(folder)
    diffs: dict[tuple[str, float], float] = {}
    for method, b, folder in entries:  # warm-up, and the engine against the torch reference on a few texts
        model, _ = load_checkpoint(folder)
        worst = 0.0
        for ids, mask in inputs[:8]:
            got = predictors[folder](ids, mask, b)
            ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))
            with torch.no_grad():
                ref = (model(ids_t, mask_t) if method == "dense" else model.hard_logits(ids_t, mask_t, b)).numpy()
            worst = max(worst, float(np.abs(got - ref).max()))
        diffs[(method, b)] = worst
    times: dict[tuple[str, float], list[float]] = {(m, b): [] for m, b, _ in entries}
    for _ in range(repeats):
        for method, b, folder in entries:
            predict = predictors[folder]
            t0 = time.perf_counter()
            for ids, mask in inputs:
                predict(ids, mask, b)
            times[(method, b)].append(1000.0 * (time.perf_counter() - t0) / max(1, len(inputs)))
    return {k: {"latency_ms": float(np.median(v)), "engine_max_abs_logit_diff": diffs[k]} for k, v in times.items()}


def spearman_figures(cfg: CompareConfig, ctx: SeedContext, entries: list[tuple[str, float, Path]]) -> dict[str, float]:
    """Rank agreement of head rankings: across budgets, and between the budgeted gates and importance."""
    from scipy.stats import spearmanr

    from headbudget.models.budget import crossing_logits
    from headbudget.training.sweep import gate_spearman

    budgeted, _ = load_checkpoint(ctx.run_dir)
    # Whole-model scope: the ranking over heads and feed-forward groups against the unit importance.
    imp = ctx.importance.units if cfg.spec.gates_ffn else ctx.importance.gradient
    out = {"budgeted_g_025_075": gate_spearman(budgeted, 0.25, 0.75),
           "budgeted_vs_importance": float(spearmanr(-crossing_logits(budgeted.gates.params()).ravel(),
                                                     imp.ravel()).statistic)}
    static = {b: f for m, b, f in entries if m == "static"}
    if 0.25 in static and 0.75 in static:
        z = [crossing_logits(load_checkpoint(static[b])[0].gates.params()).ravel() for b in (0.25, 0.75)]
        out["static_025_vs_075"] = float(spearmanr(z[0], z[1]).statistic)
    return out
