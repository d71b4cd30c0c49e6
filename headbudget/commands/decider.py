"""`headbudget decider`: calibrate a budgeted checkpoint's decider for budget=auto (decider.json beside it)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from headbudget.commands.common import existing_dir, positive_int
from headbudget.engine.names import PRECISION_NAMES, DeciderKind

BOTH = "both"  # --kind: calibrate every kind, compare them on the test split and keep the better


def _targets(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"targets: comma-separated budgets, got {text!r}") from None
    if not values or not all(0.1 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"targets must be budgets in [0.1, 1], got {text!r}")
    return values


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("decider", help="calibrate the decider that serves budget=auto on a budgeted checkpoint")
    p.add_argument("--model", required=True, type=existing_dir, help="budgeted checkpoint folder (decider.json "
                                                                       "is written into it)")
    p.add_argument("--data", required=True, help="the checkpoint's data: synthetic, a folder, or a data set name")
    p.add_argument("--kind", choices=(*DeciderKind, BOTH), default=None,
                   help="cascade (confidence of a cheap first pass), predictor (learned from the input's pooled "
                        "embeddings), or both: compare them on the test split at equal measured latency and keep "
                        "the better (default: the engine's DEFAULT_KIND)")
    p.add_argument("--out", type=Path, default=None, help="folder for auto.json (the comparison; default --model)")
    p.add_argument("--precision", choices=PRECISION_NAMES, default="fp32",
                   help="the ONNX Runtime engine that computes every budget's answers (serve with the same)")
    p.add_argument("--limit", type=positive_int, default=4000, help="validation texts to calibrate on")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                   help="ONNX Runtime threads for the calibration passes (default: every core)")
    p.add_argument("--test-limit", type=positive_int, default=None, help="test texts for the comparison")
    p.add_argument("--latency-examples", type=positive_int, default=200,
                   help="test texts timed one at a time for the comparison")
    p.add_argument("--repeats", type=positive_int, default=3, help="timings per text and configuration")
    p.add_argument("--targets", type=_targets, default=None,
                   help="operating points: fixed budgets whose mean cost each point may spend (comma-separated)")
    p.add_argument("--default-target", type=float, default=None,
                   help="the operating point budget=auto alone runs (default: the cheapest within half a point "
                        "of the whole budget's validation accuracy)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from headbudget.commands.common import CliError
    from headbudget.engine.artifacts import checkpoint_config
    from headbudget.engine.decider import DECIDER_FILE, KINDS, save_decider
    from headbudget.engine.names import DEFAULT_KIND
    from headbudget.experiments.auto_report import auto_report, measurement_engine, print_report, winner
    from headbudget.experiments.report import checkpoint_split
    from headbudget.models.model_types import model_type
    from headbudget.training.decider import TARGETS, collect, fit

    config, cfg = checkpoint_config(args.model)
    if not model_type(cfg.model_type).static_plans:
        raise CliError(f"{args.model}: a {cfg.model_type} checkpoint chooses its own budget per input; a decider "
                       "serves budget=auto on budgeted checkpoints only")
    # The answers are the same on any number of threads, so the calibration takes every core; the comparison's
    # timings (--kind both) run on one thread, as a worker serves.
    calibration = measurement_engine(args.model, args.precision, threads=args.threads)
    ds, val, _ = checkpoint_split(args.model, config, cfg.labels, cfg.max_position, args.data, "validation",
                                  args.limit)
    print(f"calibrating on {len(val)} validation texts of {ds.name}: every grid budget through the "
          f"{args.precision} engine")
    passes = collect(calibration, val)
    kinds = KINDS if args.kind == BOTH else (DeciderKind(args.kind or DEFAULT_KIND),)
    targets = args.targets or TARGETS
    made = {}
    for kind in kinds:
        d = fit(kind, passes, calibration.info.checksum, cfg.labels, targets, default_target=args.default_target)
        d.meta.update(dataset=ds.name, split="validation", precision=args.precision)
        made[kind] = d
        print(f"{kind}: " + "; ".join(f"target {p.target:.2f}: cost {p.mean_cost:.3f} acc {p.accuracy:.4f}"
                                      for p in d.points) + f" (default target {d.default_point.target:.2f})")
    keep = kinds[0]
    if len(kinds) > 1:
        _, test, _ = checkpoint_split(args.model, config, cfg.labels, cfg.max_position, args.data, "test",
                                      args.test_limit)
        timing = calibration if args.threads == 1 else measurement_engine(args.model, args.precision)
        doc = auto_report(timing, test, list(made.items()), ds.name, "test", args.latency_examples, args.repeats)
        keep = DeciderKind(winner(doc))
        for d in doc["deciders"]:
            d["kept"] = d["name"] == keep
        out = args.out or args.model
        out.mkdir(parents=True, exist_ok=True)
        (out / "auto.json").write_text(json.dumps(doc, indent=2) + "\n")
        print_report(doc)
        print(f"kept {keep}; wrote {out / 'auto.json'}")
    path = save_decider(made[keep], args.model)
    print(f"wrote {path} ({keep}); serve it: budget=auto (see {DECIDER_FILE} for its operating points)")
    return 0
