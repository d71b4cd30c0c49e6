"""The issue-8 comparison in one file: each adaptive checkpoint against the dense model and the budgeted one.

    python -m headbudget.experiments.adaptive.summary --data ../shared/data/ag_news \\
        --budgetformer DIR --span DIR --adaattention DIR --budgeted DIR \\
        --out docs/results/ag_news/compare-adaptive/adaptive.json

Reads each adaptive checkpoint's ``adaptive_sweep.json`` (written by train/eval), evaluates the budgeted
checkpoint at the budget whose k heads match BudgetFormer's mean cost (same test split, reference model),
and times everything on this CPU (one thread, batch 1): real test texts at their own lengths through each
adaptive fast path against its own dense run and the budgeted checkpoint's ONNX Runtime engine (at the
matched budget and at 1.0, i.e. dense), and fixed lengths 128 and 512 for every type.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser
from headbudget.engine.errors import EngineError
from headbudget.models.model_types import adaptive_types, model_type

# The engine, models and data imports (torch and ONNX Runtime among them) happen inside the functions that
# use them, so that `headbudget --help` and the CLI's argument parsing stay fast.

def matched_budget(mean_cost: float, n_layers: int, n_heads: int) -> tuple[float, int]:
    """The budget whose k = round(b * L * H) is the head count closest to ``mean_cost`` of all heads."""
    from headbudget.models.budget import n_kept

    total = n_layers * n_heads
    k = max(1, round(mean_cost * total))
    b = k / total
    assert n_kept(b, n_layers, n_heads) == k
    return b, k


def budgeted_accuracy(folder: Path, data_spec: str, budget: float) -> dict[str, Any]:
    """Hard accuracy of the budgeted checkpoint at ``budget`` and dense (b = 1) on the test split."""
    from headbudget.experiments.report import checkpoint_split
    from headbudget.models.checkpoint import load_checkpoint
    from headbudget.training.evaluation import accuracy

    model, config = load_checkpoint(folder)
    _, _, data = checkpoint_split(folder, config, model.cfg.labels, model.cfg.max_position, data_spec, "test")
    return {"budget": budget, "accuracy_hard": accuracy(model, data, "hard", budget),
            "accuracy_b1": accuracy(model, data, "hard", 1.0), "n_examples": len(data)}


def summarise(data: Path, checkpoints: dict[str, Path], budgeted: Path, texts: int, repeats: int,
              lengths: tuple[int, ...] = (128, 512)) -> dict[str, Any]:
    """Everything the results table needs, as one JSON-able dict."""
    from headbudget.experiments.adaptive.bench import Other, bench_lengths, bench_texts
    from headbudget.experiments.bench import cpu_name
    from headbudget.models.checkpoint import load_checkpoint

    out: dict[str, Any] = {"dataset": data.name, "cpu": cpu_name(), "date": datetime.date.today().isoformat(),
                           "budgeted_checkpoint": str(budgeted), "types": {}}
    ref, _ = load_checkpoint(budgeted)
    for kind, folder in checkpoints.items():
        report = json.loads((folder / "adaptive_sweep.json").read_text())
        report.pop("predicted_budgets", None)  # per-text list: in the checkpoint's own file, not here
        entry: dict[str, Any] = {"checkpoint": str(folder), "report": report}
        # The budgeted checkpoint on both runtimes: ONNX Runtime is what the product serves it on; the torch
        # backend is the like-for-like check, since the adaptive types run on a PyTorch path.
        others = [Other("budgeted_dense_ort", budgeted, 1.0), Other("budgeted_dense_torch", budgeted, 1.0, "torch")]
        if model_type(kind).supports_auto:  # it predicts a head budget: compare at the budget of its mean
            b, k = matched_budget(report["mean_cost"], ref.cfg.n_layers, ref.cfg.n_heads)
            entry["budgeted_at_mean_cost"] = {**budgeted_accuracy(budgeted, str(data), b), "heads": k}
            others += [Other("budgeted_matched_ort", budgeted, b), Other("budgeted_matched_torch", budgeted, b, "torch")]
        entry["latency_texts"] = bench_texts(folder, data, texts, 10, others)
        entry["latency_lengths"] = bench_lengths(folder, lengths, repeats, 3, data)
        out["types"][kind] = entry
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options, shared by this module's CLI and `headbudget compare-adaptive`."""
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--budgeted", type=Path, required=True, help="the budgeted checkpoint to compare with")
    for kind in adaptive_types():
        p.add_argument(f"--{kind}", type=Path, default=None, help=f"a trained {kind} checkpoint")
    p.add_argument("--texts", type=int, default=300, help="real test texts timed at their own lengths")
    p.add_argument("--repeats", type=int, default=20, help="inputs timed per fixed length")
    p.add_argument("--lengths", default="128,512", help="fixed lengths timed for every type (comma-separated)")
    p.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    """Check the inputs, summarise, write ``--out``; one-line errors, exit code 2."""
    checkpoints = {k: getattr(args, k) for k in adaptive_types() if getattr(args, k)}
    try:
        for folder in [*checkpoints.values(), args.budgeted]:
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"{folder}: not a checkpoint folder")
        for folder in checkpoints.values():
            if not (folder / "adaptive_sweep.json").is_file():
                raise FileNotFoundError(f"{folder}: no adaptive_sweep.json; run `headbudget eval` on it first")
        lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
        if not checkpoints:
            raise ValueError("give at least one of " + ", ".join(f"--{k}" for k in adaptive_types()))
        result = summarise(args.data, checkpoints, args.budgeted, args.texts, args.repeats, lengths)
    except (OSError, ValueError, EngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI; one-line errors, exit code 2."""
    p = OneLineParser(prog="python -m headbudget.experiments.adaptive.summary", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
