"""`headbudget compare`: the budgeted checkpoint against post-hoc pruning, recovery and static gates; with
``--scope model``, the whole-model budget against the attention-only checkpoint, post-hoc pruning of heads and
neurons and dedicated small models, placed by measured latency."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from headbudget.commands.common import budget_arg, positive_int
from headbudget.engine.names import BACKEND_NAMES
from headbudget.models.config import SCOPE_SPECS, SCOPES  # torch-free


def _list(kind: type, name: str, check=None):  # type: ignore[no-untyped-def]
    """argparse type: a comma-separated, non-empty list without duplicates."""

    def parse(text: str) -> tuple:  # type: ignore[type-arg]
        items = [t.strip() for t in text.split(",") if t.strip()]
        try:
            values = tuple(check(t) if check else kind(t) for t in items)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentTypeError(f"{name}: {e}" if check else f"{name}: expected comma-separated "
                                             f"{kind.__name__}s, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name}: expected at least one value, got {text!r}")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{name}: duplicate values in {text!r}")
        return values

    return parse


def _budget(text: str) -> float:
    b = budget_arg(text)
    if b >= 1.0:
        raise argparse.ArgumentTypeError(f"budget must be below 1 (b = 1 is the dense row), got {text!r}")
    return b


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("compare", help="compare the budgeted checkpoint with pruning, static and small-model baselines")
    p.add_argument("--data", required=True, help="synthetic, a folder with train/test files, or a HF dataset name")
    p.add_argument("--seeds", type=_list(int, "--seeds"), default=(7, 13, 21), help="e.g. 7,13,21")
    p.add_argument("--budgets", type=_list(float, "--budgets", _budget), default=(0.25, 0.5, 0.75),
                   help="e.g. 0.25,0.5,0.75")
    p.add_argument("--base", default="minilm", choices=("minilm", "tiny"))
    p.add_argument("--recipe", default="full", choices=("smoke", "quick", "full"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (repeatable)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (training; latency is always CPU)")
    p.add_argument("--importance-examples", type=positive_int, default=2000)
    p.add_argument("--ablation-examples", type=int, default=500, help="0 skips the mask-one-head score")
    p.add_argument("--limit", type=positive_int, default=None, help="test examples to evaluate (default all)")
    p.add_argument("--latency-texts", type=int, default=200, help="test texts timed per artifact (0 = skip)")
    p.add_argument("--latency-repeats", type=positive_int, default=3)
    p.add_argument("--scope", default="attention", choices=SCOPES,
                   help="what the budget spans: attention heads (the published comparison) or the whole model "
                        "(heads and feed-forward groups, against the attention-only run and small models)")
    p.add_argument("--exits", default="", metavar="D[,D...]",
                   help="--scope model: train the budgeted checkpoint with exits at these depths (as train --exits)")
    p.add_argument("--backend", default="onnxruntime", choices=BACKEND_NAMES,
                   help="the engine that latency is measured on (torch: the masked reference model)")
    p.add_argument("--out", required=True, type=Path, help="folder for artifacts (cached) and the report")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from headbudget.commands.common import CliError, parse_exits
    from headbudget.experiments.compare.measure import engine_factory
    from headbudget.experiments.compare.run import CompareConfig, run_compare
    from headbudget.training.data import load_data
    from headbudget.training.recipes import get_recipe, parse_overrides

    if args.ablation_examples < 0 or args.latency_texts < 0:
        raise CliError("--ablation-examples and --latency-texts must be >= 0")
    try:
        recipe = get_recipe(args.recipe, **parse_overrides(args.overrides))
    except ValueError as e:
        raise CliError(str(e)) from None
    exits = parse_exits(args.exits)
    if exits and not SCOPE_SPECS[args.scope].exits:
        with_exits = " or ".join(s for s in SCOPES if SCOPE_SPECS[s].exits)
        raise CliError(f"--exits (layer skipping) is for --scope {with_exits}")
    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"--out {args.out} is a file; give a folder")
    load_data(args.data, synthetic_size=recipe.synthetic_size)  # fail fast, before any training, on bad data
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = CompareConfig(data=args.data, seeds=args.seeds, budgets=tuple(sorted(args.budgets)), recipe=recipe,
                        base=args.base, device=device, importance_examples=args.importance_examples,
                        ablation_examples=args.ablation_examples, test_limit=args.limit,
                        latency_texts=args.latency_texts, latency_repeats=args.latency_repeats,
                        scope=args.scope, exits=exits, latency_engine=f"{args.backend} fp32, 1 thread, batch 1",
                        extra={"command": "headbudget " + shlex.join(sys.argv[1:]) if sys.argv[1:] else None})
    doc = run_compare(cfg, args.out, engine_factory(args.backend, cfg.budgets))
    print((args.out / "compare.md").read_text())
    print(f"wrote {args.out / 'compare.json'}, {args.out / 'compare.md'}, {args.out / 'compare.png'} "
          f"({doc['wall_seconds']:.0f} s)")
    return 0
