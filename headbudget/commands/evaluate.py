"""`headbudget eval`: the 19-budget sweep of a checkpoint (sweep.json, pareto.png)."""

from __future__ import annotations

import argparse
from pathlib import Path

from headbudget.commands.common import existing_dir, positive_int


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("eval", help="sweep a checkpoint over the 19 budgets on a split")
    p.add_argument("--model", required=True, type=existing_dir, help="checkpoint folder")
    p.add_argument("--data", required=True, help="synthetic, a folder with train/test files, or a HF dataset name")
    p.add_argument("--split", default="test", choices=("train", "validation", "test"))
    p.add_argument("--out", required=True, type=Path, help="folder for sweep.json and pareto.png")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N examples")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the reference model's device)")
    p.add_argument("--int8", action="store_true", help="add the int8 engine's hard accuracy per budget")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from headbudget.training.report import evaluate_checkpoint

    extra = _int8_runner(args.model) if args.int8 else None
    sweep = evaluate_checkpoint(args.model, args.data, args.split, args.out, limit=args.limit, extra_hard=extra,
                                device=args.device)
    print(f"{'budget':>6} {'heads':>7} {'soft_cost':>9} {'acc_soft':>8} {'acc_hard':>8}")
    for p in sweep["points"]:
        print(f"{p['budget']:>6.2f} {p['heads_active']:>3}/{p['heads_total']:<3} {p['soft_cost']:>9.3f} "
              f"{p['accuracy_soft']:>8.4f} {p['accuracy_hard']:>8.4f}")
    print(f"dense {sweep['dense_accuracy']:.4f}; nested {sweep['nested']}; "
          f"spearman(0.25, 0.75) {sweep['spearman_025_075']:.3f}; wrote {args.out / 'sweep.json'}")
    return 0


def _int8_runner(folder: Path):  # type: ignore[no-untyped-def]
    """Hard accuracy through the int8 engine, as a per-budget column of the sweep."""
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions

    engine = load_engine(folder, EngineOptions(precision="int8"))

    def make(data):  # type: ignore[no-untyped-def]
        def acc(budget: float) -> float:
            labels = list(engine.info.labels)
            right = 0
            for start in range(0, len(data), 32):
                ids = data.ids[start : start + 32]
                res = engine.predict_ids(ids, budget)
                right += sum(int(labels.index(p.label) == y) for p, y in zip(res.predictions, data.labels[start:start + 32], strict=True))
            return right / max(1, len(data))
        return {"accuracy_hard_int8": acc}

    return make
