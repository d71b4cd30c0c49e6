"""`headbudget eval`: the 19-budget sweep of a checkpoint (sweep.json, pareto.png)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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
    p.add_argument("--add-int8", action="store_true",
                   help="only add the int8 column to the sweep.json already in --out (same data and split)")
    p.add_argument("--no-auto", action="store_true",
                   help="skip budget=auto's report (auto.json), made when the checkpoint has a decider.json")
    p.add_argument("--auto-latency-examples", type=positive_int, default=200,
                   help="texts timed one at a time for auto.json's latencies")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from headbudget.experiments.report import evaluate_checkpoint
    from headbudget.models.checkpoint import read_config
    from headbudget.models.model_types import model_type

    kind = str(read_config(args.model).get("model", {}).get("model_type", "budgeted"))
    if not model_type(kind).static_plans:
        return _eval_adaptive(args, kind)
    if args.add_int8:
        return _add_int8(args)
    extra = _int8_runner(args.model) if args.int8 else None
    sweep = evaluate_checkpoint(args.model, args.data, args.split, args.out, limit=args.limit, extra_hard=extra,
                                device=args.device)
    print(f"{'budget':>6} {'heads':>7} {'soft_cost':>9} {'acc_soft':>8} {'acc_hard':>8}")
    for p in sweep["points"]:
        print(f"{p['budget']:>6.2f} {p['heads_active']:>3}/{p['heads_total']:<3} {p['soft_cost']:>9.3f} "
              f"{p['accuracy_soft']:>8.4f} {p['accuracy_hard']:>8.4f}")
    print(f"dense {sweep['dense_accuracy']:.4f}; nested {sweep['nested']}; "
          f"spearman(0.25, 0.75) {sweep['spearman_025_075']:.3f}; wrote {args.out / 'sweep.json'}")
    if not args.no_auto:
        _auto(args, sweep)
    return 0


def _auto(args: argparse.Namespace, sweep: dict[str, Any]) -> None:
    """With a decider.json beside the weights: budget=auto against the fixed budgets on the same split, at
    measured latency (auto.json), and its panel on pareto.png."""
    import json

    from headbudget.engine.decider import DECIDER_FILE

    if not (args.model / DECIDER_FILE).is_file():
        return
    from headbudget.engine.artifacts import checkpoint_config
    from headbudget.experiments.auto_report import auto_report, measurement_engine, print_report
    from headbudget.experiments.plots import load_benches, pareto_plot
    from headbudget.experiments.report import checkpoint_split

    engine = measurement_engine(args.model)
    decider = engine.info.decider
    if decider is None:
        print(f"{args.model / DECIDER_FILE}: not usable (see the warning above); no auto report")
        return
    config, cfg = checkpoint_config(args.model)
    ds, split, _ = checkpoint_split(args.model, config, cfg.labels, cfg.max_position, args.data, args.split,
                                    args.limit)
    doc = auto_report(engine, split, [(decider.kind, decider)], ds.name, args.split, args.auto_latency_examples)
    (args.out / "auto.json").write_text(json.dumps(doc, indent=2) + "\n")
    pareto_plot(sweep, args.out / "pareto.png", benches=load_benches(args.model, args.out), auto=doc)
    print_report(doc)
    print(f"wrote {args.out / 'auto.json'}")


def _add_int8(args: argparse.Namespace) -> int:
    """Append accuracy_hard_int8 to an existing sweep.json, checking that it was made on the same split."""
    import json

    from headbudget.commands.common import CliError
    from headbudget.experiments.plots import load_benches, pareto_plot
    from headbudget.experiments.report import align_labels
    from headbudget.models.checkpoint import read_config
    from headbudget.models.tokenizer import TextEncoder
    from headbudget.training.batches import tokenize
    from headbudget.training.data import load_data

    path = args.out / "sweep.json"
    if not path.is_file():
        raise CliError(f"{path}: missing; run eval without --add-int8 first")
    sweep = json.loads(path.read_text())
    config = read_config(args.model)
    data_meta = config.get("data", {})
    ds = load_data(args.data, data_meta.get("text_column", "text"), data_meta.get("label_column", "label"),
                   seed=int(config.get("seed", 7)))
    part = align_labels(ds, ds.split(args.split).take(args.limit), tuple(config["model"]["labels"]))
    if (sweep.get("dataset"), sweep.get("split"), sweep.get("n_examples")) != (ds.name, args.split, len(part)):
        raise CliError(f"{path}: made on {sweep.get('dataset')}/{sweep.get('split')} "
                       f"({sweep.get('n_examples')} examples), not {ds.name}/{args.split} ({len(part)})")
    data = tokenize(part, TextEncoder(args.model, int(config.get("max_length", 512))))
    run = _int8_runner(args.model)(data)["accuracy_hard_int8"]
    for point in sweep["points"]:
        point["accuracy_hard_int8"] = run(point["budget"])
        print(f"{point['budget']:>6.2f} fp32 {point['accuracy_hard']:.4f} int8 {point['accuracy_hard_int8']:.4f}")
    path.write_text(json.dumps(sweep, indent=2) + "\n")
    auto = json.loads((args.out / "auto.json").read_text()) if (args.out / "auto.json").is_file() else None
    pareto_plot(sweep, args.out / "pareto.png", benches=load_benches(args.model, args.out), auto=auto)
    return 0


def _int8_runner(folder: Path):  # type: ignore[no-untyped-def]
    """Hard accuracy through the ONNX Runtime int8 engine, as a per-budget column of the sweep."""
    import numpy as np

    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions
    from headbudget.models.tokenizer import Encoded

    engine = load_engine(folder, EngineOptions(precision="int8"))

    def make(data):  # type: ignore[no-untyped-def]
        order = np.argsort([len(x) for x in data.ids], kind="stable")  # length-sorted batches: less padding

        def acc(budget: float) -> float:
            right = 0
            for start in range(0, len(order), 32):
                idx = order[start : start + 32]
                ids, mask = Encoded([data.ids[i] for i in idx], [False] * len(idx)).padded()
                logits = engine.predict_ids(ids, mask, budget)
                right += int((logits.argmax(1) == data.labels[idx]).sum())
            return right / max(1, len(data))

        return {"accuracy_hard_int8": acc}

    return make


def _eval_adaptive(args: argparse.Namespace, model_type: str) -> int:
    """The adaptive report instead of the budget sweep (those types have no budget-conditioned gates)."""
    import json

    from headbudget.commands.common import CliError
    from headbudget.experiments.adaptive.report import evaluate_adaptive

    if args.int8 or args.add_int8:
        raise CliError(f"--int8: the {model_type} type runs on the fp32 adaptive path only")
    rep = evaluate_adaptive(args.model, args.data, args.split, args.out, limit=args.limit, device=args.device)
    summary = {k: rep[k] for k in ("model_type", "n_examples", "accuracy", "dense_accuracy", "mean_cost",
                                   "mean_span", "accuracy_long", "dense_accuracy_long", "full_head_fraction",
                                   "mean_dim_fraction") if k in rep}
    print(json.dumps(summary))
    print(f"wrote {args.out / 'adaptive_sweep.json'}")
    return 0
