"""The all-budget benchmark: every budget of the grid and a few off-grid ones, timed round-robin in one process.

Where ``run_bench`` times five headline budgets against every dense runtime, this times the whole budget axis
against the one dense ORT peer of the same precision, so that latency can be read as a function of the budget
(and drawn as the latency panel of pareto.png). Same protocol as bench.py: one thread, pre-tokenized inputs,
warm-up, round-robin rounds. Each row says what share of b = 1's latency the budget takes next to the share of
multiply-adds it runs, and ``checks`` flags budgets that miss the expected shape of that curve.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from headbudget.engine.protocol import TokenEngine
from headbudget.experiments.bench import (
    BenchConfig,
    _at_budget,
    _ms,
    code_commit,
    cpu_name,
    make_batches,
    memory_figure,
    ratio_ci95,
    time_round_robin,
)
from headbudget.models.budget import BUDGET_GRID, check_budget
from headbudget.models.plan import ExecutionPlan, Shape

MODE = "all-budgets"  # the file's "mode": how the pareto plot tells it from a bench.json
OFF_GRID_BUDGETS: tuple[float, ...] = (0.37, 0.62, 0.88)
# A budget may take at most its own share of b = 1's latency plus this: the fixed per-call work (embeddings,
# Python, feeds) does not shrink with the budget, so small budgets cannot reach their MAC share.
RULE_SLACK = 0.15
# A budget's median may exceed a larger budget's by this factor before it counts as non-monotone: medians of
# a few dozen rounds on a shared CPU move by a few percent between neighbouring budgets.
MONOTONE_TOLERANCE = 1.03


@dataclass(frozen=True)
class BudgetBenchConfig:
    bench: BenchConfig  # model, lengths, precision, repeats, threads, cache (``memory`` is not measured here)
    off_grid: tuple[float, ...] = field(default=OFF_GRID_BUDGETS)

    def budgets(self) -> tuple[float, ...]:
        """The grid and the off-grid budgets, ascending, each once."""
        extra = tuple(round(check_budget(b), 4) for b in self.off_grid)
        if any(b <= 0.0 for b in extra):
            raise ValueError(f"off-grid budgets must be in (0, 1], got {self.off_grid}")
        return tuple(sorted(set(BUDGET_GRID) | set(extra)))


def mac_fraction(plan: ExecutionPlan, shape: Shape, lengths: Sequence[int]) -> float:
    """The plan's share of the dense multiply-adds, averaged over the timed texts' own lengths.

    The mean over texts rather than the share at the median length: the attention scores grow as n², so the
    share moves with length, and each timed text counts once in the latency median it is set beside. At a
    fixed length every text has that length and this is the share at it."""
    shares = {n: plan.cost(shape, n).ratio for n in set(lengths)}
    return round(float(np.mean([shares[n] for n in lengths])), 4)


def budget_checks(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per budget: ``within_rule`` (share_of_b1 <= budget + RULE_SLACK) and ``monotone`` (latency at most
    MONOTONE_TOLERANCE times the fastest larger budget's); then the totals and the budgets failing either."""
    ordered = sorted(rows, key=lambda r: r["budget"])
    per_row = []
    fastest_above = float("inf")
    for row in reversed(ordered):  # from b = 1 down, carrying the smallest latency seen above
        per_row.append({"budget": row["budget"],
                        "within_rule": bool(row["share_of_b1"] <= row["budget"] + RULE_SLACK),
                        "monotone": bool(row["latency_ms"] <= MONOTONE_TOLERANCE * fastest_above)})
        fastest_above = min(fastest_above, row["latency_ms"])
    per_row.reverse()
    return {
        "rule": f"share_of_b1 <= budget + {RULE_SLACK}",
        "monotone_rule": f"latency_ms <= {MONOTONE_TOLERANCE} * min latency_ms of every larger budget",
        "rows": per_row,
        "all_within_rule": all(r["within_rule"] for r in per_row),
        "all_monotone": all(r["monotone"] for r in per_row),
        "failing_budgets": [r["budget"] for r in per_row if not (r["within_rule"] and r["monotone"])],
    }


def floor_plan(engine: TokenEngine) -> ExecutionPlan:
    """One head and one feed-forward group in every layer: the least a pass through all the layers runs, timed
    beside the budgets to show the per-pass work (norms, softmax, activation quantization, dispatch) that no
    budget can save."""
    cfg = engine.cfg
    ffn = (cfg.gate.ffn_group,) * cfg.n_layers if cfg.ffn_groups else None
    return ExecutionPlan(heads=(1,) * cfg.n_layers, n_heads=cfg.n_heads, ffn=ffn)


def _budget_rows(engine: TokenEngine, budgets: Sequence[float], times: dict[str, list[float]], peer: str,
                 lengths: list[int]) -> list[dict[str, Any]]:
    """One row per budget: its latency, its share of b = 1's and of the dense peer's, and its share of MACs."""
    b1, ort = np.median(times["engine@1.0"]), np.median(times[peer])
    rows = []
    for b in budgets:
        t = times[f"engine@{b}"]
        plan = engine.plan(b)
        rows.append({"budget": b, "latency_ms": _ms(t, 0.5), "p90_ms": _ms(t, 0.9),
                     "share_of_b1": round(float(np.median(t) / b1), 4),
                     "share_of_b1_ci95": ratio_ci95(t, times["engine@1.0"]),
                     "share_of_ort_dense": round(float(np.median(t) / ort), 4),
                     "mac_fraction": mac_fraction(plan, engine.shape, lengths),
                     "heads_active": plan.heads_active, "layers_run": plan.layers_run})
    return rows


def run_budget_bench(cfg: BudgetBenchConfig) -> dict[str, Any]:
    """Time every budget and the dense ORT peer of the same precision; the document the CLI writes, less
    ``command`` (the CLI knows it)."""
    import torch

    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions
    from headbudget.experiments import peers
    from headbudget.models.checkpoint import load_checkpoint

    bench = cfg.bench
    budgets = cfg.budgets()
    torch.set_num_threads(bench.threads)
    model, _ = load_checkpoint(bench.model_dir)
    engine = load_engine(bench.model_dir, EngineOptions(precision=bench.precision, threads=bench.threads))
    engine.warmup()
    batches = make_batches(engine, bench)
    peer = f"ort_{bench.precision}"
    methods: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {
        f"engine@{b}": partial(_at_budget, engine, b) for b in budgets
    }
    floor = floor_plan(engine)
    methods["floor"] = partial(engine.forward_ids, plan=floor)
    with tempfile.TemporaryDirectory(prefix="headbudget-bench-") as work:
        dense_fp32, dense_int8 = peers.export_dense(model, Path(work))
        dense = dense_fp32 if bench.precision == "fp32" else dense_int8
        methods[peer] = peers.ort_runner(peers.ort_session(dense, bench.threads))
        times = time_round_robin(methods, batches, bench.warmup, bench.cache, shuffle=True)
        # Every budget as served against one dense session of this precision, each in a fresh process.
        memory = (memory_figure(bench.model_dir, dense_fp32, bench.precision, bench.memory_probes)
                  if bench.memory_probes else None)
    lengths = [int(n) for _, mask in batches[bench.warmup:] for n in mask.sum(1)]
    b1 = np.median(times["engine@1.0"])
    rows = _budget_rows(engine, budgets, times, peer, lengths)
    return {
        "mode": MODE, "model": engine.info.name, "precision": bench.precision,
        "seq_len": bench.seq_len if bench.data is None else "data", "median_tokens": int(np.median(lengths)),
        "batch_size": bench.batch_size, "repeats": bench.repeats, "threads": bench.threads, "cache": bench.cache,
        "cpu": cpu_name(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": code_commit(), "off_grid_budgets": sorted(set(budgets) - set(BUDGET_GRID)),
        "rows": rows, "peers": {f"{peer}_ms": _ms(times[peer], 0.5)}, "checks": budget_checks(rows),
        "floor": {"heads_per_layer": list(floor.heads), "neurons_per_layer": None if floor.ffn is None else list(floor.ffn),
                  "latency_ms": _ms(times["floor"], 0.5),
                  "share_of_b1": round(float(np.median(times["floor"]) / b1), 4),
                  "mac_fraction": mac_fraction(floor, engine.shape, lengths)},
        **({"memory": memory} if memory is not None else {}),
    }
