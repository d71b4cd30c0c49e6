"""`headbudget train`: the three-stage budgeted recipe, resumable, ending with a sweep of the result."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from headbudget.commands.common import CliError, parse_exits, positive_int
from headbudget.models.config import MODEL_TYPES, SCOPES
from headbudget.training.recipes import RECIPE_NAMES, RunConfig, get_preset, parse_overrides  # torch-free


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train", help="train a budget-conditioned checkpoint")
    p.add_argument("--base", default="minilm",
                   help="minilm, tiny, or a local Hugging Face folder: a BERT, RoBERTa, XLM-R or DistilBERT encoder, "
                        "or a fine-tuned sequence classifier of one (its labels matching the data skip the dense stage)")
    p.add_argument("--data", required=True, help="synthetic, a folder with train/test files, or a HF dataset name")
    p.add_argument("--recipe", default="quick", choices=RECIPE_NAMES,
                   help="smoke (tiny base, synthetic data), quick (minutes on a CPU), full (all the data), or "
                        "release: full with the options and gate settings of the published checkpoint "
                        "(--scope model --exits 3, dense-teacher sandwich stage 3 for 10 epochs)")
    p.add_argument("--model", default="budgeted", choices=MODEL_TYPES, help="model type")
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder (resumes if it holds this run)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--structural", action="store_true", help="keep at least one head in every layer")
    p.add_argument("--scope", default=None, choices=SCOPES,
                   help="what a budget spans: the whole model (heads and feed-forward neuron groups, b = the "
                        "fraction of multiply-adds; the default for budgeted models) or attention heads only "
                        "(the adaptive model types' only scope)")
    p.add_argument("--exits", default=None, metavar="D[,D...]",
                   help="layer skipping (--scope model): depths with an exit head; low budgets fill the layers "
                        "below the first exit and stop there, e.g. --exits 3 (default: the recipe's, else none)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--examples-per-stage", type=positive_int, default=None, help="override the recipe's cap")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set gate_lr=0.1 (repeatable)")
    p.add_argument("--no-sweep", action="store_true",
                   help="measure nothing after training: no test-split sweep, and no last validation where it "
                        "would select nothing")
    p.set_defaults(func=run)


def resolve(args: argparse.Namespace, device: str = "cpu") -> RunConfig:
    """The run the parsed flags ask for: the recipe's preset, then --set and the gate flags over it."""
    try:
        overrides = parse_overrides(args.overrides)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.examples_per_stage:
        overrides["examples_per_stage"] = args.examples_per_stage
    preset = get_preset(args.recipe)
    # A preset's gate settings are a budgeted model's; the adaptive types, and --structural, budget attention
    # alone. Its exits come with its scope.
    attention_only = args.model != "budgeted" or args.structural
    scope = args.scope or ("attention" if attention_only else preset.scope)
    exits = parse_exits(args.exits) if args.exits is not None else (preset.exits if scope == preset.scope else ())
    return RunConfig(base=args.base, data=args.data, recipe=replace(preset.recipe, **overrides), seed=args.seed,
                     structural=args.structural, text_column=args.text_column, label_column=args.label_column,
                     device=device, model_type=args.model, scope=scope, exits=exits)


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    # The flags are checked before torch, scipy and matplotlib load: a bad one is refused in a second, not six.
    run_cfg = resolve(args, args.device)
    run_cfg = replace(run_cfg, device=_device(args.device))
    device, recipe = run_cfg.device, run_cfg.recipe
    from headbudget.training.trainer import train

    out = train(run_cfg, args.out, final_evaluation=not args.no_sweep)
    if not args.no_sweep and args.model != "budgeted":
        from headbudget.experiments.adaptive.report import evaluate_adaptive

        rep = evaluate_adaptive(out, args.data, "test", out, limit=recipe.sweep_examples, device=device)
        dense = rep.get("dense_accuracy")
        print(f"{out}: {args.model} accuracy {rep['accuracy']:.4f}"
              + (f" (dense warm start {dense:.4f})" if dense is not None else "")
              + f" on {rep['n_examples']} test examples")
    elif not args.no_sweep:
        from headbudget.experiments.report import evaluate_checkpoint

        sweep = evaluate_checkpoint(out, args.data, "test", out, limit=recipe.sweep_examples, device=device)
        half = next(p for p in sweep["points"] if abs(p["budget"] - 0.5) < 1e-9)
        kept = f"{half['heads_active']}/{half['heads_total']} heads"
        if "neurons_active" in half:
            kept += (f", {half['neurons_active']}/{half['neurons_total']} feed-forward neurons, "
                     f"{half['macs_fraction']:.2f} of the multiply-adds at {sweep['ref_length']} tokens")
        print(f"{out}: dense {sweep['dense_accuracy']:.4f}, hard b=0.5 {half['accuracy_hard']:.4f} "
              f"({kept}) on {sweep['n_examples']} test examples")
    else:
        print(f"{out}: trained")
    return 0
