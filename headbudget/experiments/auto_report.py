"""``budget=auto`` against the fixed budgets on one split, by accuracy at equal *measured* mean latency (auto.json).

Accuracy and mean cost: every test text, through the serving engine's own paths (``predict`` at each grid
budget, ``run`` with ``Auto`` at each of a decider's operating points, batches of 32). Latency: the first
``latency_examples`` texts, one at a time (batch 1, one thread), each configuration timed around the whole call
(tokenizing, every pass, the answer), round robin over the configurations so that drift on a shared machine
hits all of them alike, in a fresh random order for every text and repeat (in a fixed order each budget would run
right after its neighbour on the grid, with much of its weights still in cache, and auto after the whole budget),
``repeats`` times; a configuration's latency is the mean over texts of each text's median. No partial budget gets
a prepacked session of its own (``prepacked_budgets=()``), so every pass, fixed or auto, runs the same all-budget
session.

The fixed curve at equal latency: the upper envelope of the fixed budgets' (latency, accuracy) points,
interpolated linearly (a random mix of two budgets reaches any point between them); ``None`` outside its range.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from headbudget.engine.base import EngineBase
from headbudget.engine.decider import Decider
from headbudget.engine.factory import load_engine
from headbudget.engine.types import Auto, EngineOptions, Precision
from headbudget.models.budget import BUDGET_GRID
from headbudget.training.data import Split

log = logging.getLogger(__name__)
BATCH = 32


def measurement_engine(model_dir: Path, precision: Precision = "fp32", threads: int = 1) -> EngineBase:
    """The ONNX Runtime engine as served, one thread unless told, without per-budget prepacked sessions (see
    above)."""
    engine = load_engine(model_dir, EngineOptions(precision=precision, prepacked_budgets=(), threads=threads))
    assert isinstance(engine, EngineBase)
    return engine


def with_decider(engine: EngineBase, decider: Decider) -> EngineBase:
    """``engine`` serving ``decider`` (to measure one that is not saved beside the checkpoint)."""
    engine.info = replace(engine.info, decider=decider, supports_auto=True)
    return engine


def _batched(texts: Sequence[str], run: Callable[[list[str]], Any]) -> list[Any]:
    """Predictions for ``texts`` in their order, run in batches of texts of similar length (less padding)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out: list[Any] = [None] * len(texts)
    for start in range(0, len(order), BATCH):
        idx = order[start:start + BATCH]
        for i, pred in zip(idx, run([texts[i] for i in idx]).predictions, strict=True):
            out[i] = pred
    return out


def frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The upper envelope of (latency, accuracy) points: each point no other beats on both, by latency."""
    env: list[tuple[float, float]] = []
    for lat, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not env or acc > env[-1][1]:
            env.append((lat, acc))
    return env


def accuracy_at(env: Sequence[tuple[float, float]], latency: float) -> float | None:
    """The envelope's accuracy at ``latency`` (linear between points; the best point at or below beyond the last;
    None below the first)."""
    if not env or latency < env[0][0]:
        return None
    for (l0, a0), (l1, a1) in zip(env, env[1:], strict=False):
        if l0 <= latency <= l1:
            return a0 + (a1 - a0) * (latency - l0) / (l1 - l0) if l1 > l0 else max(a0, a1)
    return env[-1][1]


def latency_at(env: Sequence[tuple[float, float]], accuracy: float) -> float | None:
    """The envelope's latency at which it first reaches ``accuracy`` (linear between points), None if never."""
    if not env or accuracy > env[-1][1]:
        return None
    if accuracy <= env[0][1]:
        return env[0][0]
    for (l0, a0), (l1, a1) in zip(env, env[1:], strict=False):
        if a0 <= accuracy <= a1:
            return l0 + (l1 - l0) * (accuracy - a0) / (a1 - a0) if a1 > a0 else l0
    return None


def measure_latency(engine: EngineBase, texts: Sequence[str], configs: dict[str, Callable[[list[str]], Any]],
                    repeats: int) -> dict[str, float]:
    """Mean over ``texts`` of each text's median wall time (ms) per configuration, batch 1, round robin."""
    for run in configs.values():  # warm every session and path once
        run([texts[0]])
    times: dict[str, list[list[float]]] = {name: [[] for _ in texts] for name in configs}
    rng = np.random.default_rng(0)
    names = list(configs)
    for _ in range(repeats):
        for i, text in enumerate(texts):
            for j in rng.permutation(len(names)):
                name = names[j]
                t0 = time.perf_counter()
                configs[name]([text])
                times[name][i].append(time.perf_counter() - t0)
    return {name: 1000.0 * float(np.mean([statistics.median(t) for t in per_text]))
            for name, per_text in times.items()}


def auto_report(engine: EngineBase, split: Split, deciders: Sequence[tuple[str, Decider]], dataset: str,
                split_name: str, latency_examples: int = 200, repeats: int = 3) -> dict[str, Any]:
    """The auto.json document: each decider's operating points against the fixed budgets on ``split``."""
    labels = engine.cfg.labels
    gold = [labels[y] for y in split.labels]
    texts = split.texts
    fixed: list[dict[str, Any]] = []
    for b in BUDGET_GRID:
        preds = _batched(texts, lambda t, b=b: engine.predict(t, b))
        fixed.append({"budget": b, "mean_cost": float(np.mean([p.cost.ratio for p in preds])),
                      "accuracy": float(np.mean([p.label == g for p, g in zip(preds, gold, strict=True)]))})
    points: list[dict[str, Any]] = []
    configs: dict[str, Callable[[list[str]], Any]] = {
        f"fixed:{b}": (lambda t, b=b: engine.predict(t, b)) for b in BUDGET_GRID}
    for name, decider in deciders:
        with_decider(engine, decider)
        for i, pt in enumerate(decider.points):
            preds = _batched(texts, lambda t, target=pt.target: engine.run(t, Auto(1.0, target)))
            points.append({
                "decider": name, "target": pt.target, "default": i == decider.default,
                "mean_cost": float(np.mean([p.cost.ratio for p in preds])),
                "accuracy": float(np.mean([p.label == g for p, g in zip(preds, gold, strict=True)])),
                "escalated": float(np.mean([len(p.passes) > 1 for p in preds])),
                "mean_budget": float(np.mean([p.budget_chosen for p in preds])),
                "setting": pt.to_dict()})
            configs[f"{name}:{pt.target}"] = _auto_run(engine, decider, pt.target)
    sample = list(texts[:latency_examples])
    log.info("auto: timing %d configurations on %d texts x %d repeats", len(configs), len(sample), repeats)
    lat = measure_latency(engine, sample, configs, repeats)
    for f in fixed:
        f["mean_latency_ms"] = round(lat[f"fixed:{f['budget']}"], 4)
    env = frontier([(f["mean_latency_ms"], f["accuracy"]) for f in fixed])
    for p in points:
        p["mean_latency_ms"] = round(lat[f"{p['decider']}:{p['target']}"], 4)
        p["fixed_accuracy_at_same_latency"] = accuracy_at(env, p["mean_latency_ms"])
        p["fixed_latency_at_same_accuracy_ms"] = latency_at(env, p["accuracy"])
    summary = []
    for name, decider in deciders:
        mine = [p for p in points if p["decider"] == name]
        gains = [p["accuracy"] - p["fixed_accuracy_at_same_latency"] for p in mine
                 if p["fixed_accuracy_at_same_latency"] is not None]
        summary.append({"name": name, "kind": decider.kind, "points": len(mine),
                        "default_target": decider.default_point.target, "meta": decider.meta,
                        "mean_gain_at_equal_latency": float(np.mean(gains)) if gains else None})
    return {"dataset": dataset, "split": split_name, "n_examples": len(texts), "latency_examples": len(sample),
            "repeats": repeats, "precision": engine.options.precision, "batch_size_latency": 1,
            "threads": engine.options.threads, "deciders": summary, "fixed": fixed, "points": points}


def _auto_run(engine: EngineBase, decider: Decider, target: float) -> Callable[[list[str]], Any]:
    """One operating point of ``decider`` as a timed configuration (the engine serves it while timed)."""

    def run(t: list[str]) -> Any:
        engine.info = replace(engine.info, decider=decider)
        return engine.run(t, Auto(1.0, target))

    return run


def winner(doc: dict[str, Any]) -> str:
    """The decider with the larger mean accuracy gain over the fixed curve at equal measured latency."""
    scored = [d for d in doc["deciders"] if d["mean_gain_at_equal_latency"] is not None]
    if not scored:
        return str(doc["deciders"][0]["name"])
    return str(max(scored, key=lambda d: d["mean_gain_at_equal_latency"])["name"])


def print_report(doc: dict[str, Any], out: Callable[[str], None] = print) -> None:
    out(f"{'decider':>10} {'target':>6} {'cost':>6} {'ms':>7} {'acc':>7} {'fixed@ms':>8} {'ms@acc':>7} {'esc':>5}")
    for p in doc["points"]:
        fa, fl = p["fixed_accuracy_at_same_latency"], p["fixed_latency_at_same_accuracy_ms"]
        out(f"{p['decider']:>10} {p['target']:>6.2f} {p['mean_cost']:>6.3f} {p['mean_latency_ms']:>7.3f} "
            f"{p['accuracy']:>7.4f} {'-' if fa is None else f'{fa:.4f}':>8} {'-' if fl is None else f'{fl:.3f}':>7} "
            f"{p['escalated']:>5.2f}{' *' if p['default'] else ''}")
    for d in doc["deciders"]:
        g = d["mean_gain_at_equal_latency"]
        out(f"{d['name']}: mean accuracy gain over the fixed budgets at equal latency "
            f"{'n/a' if g is None else f'{100 * g:+.2f} points'}")
