"""`headbudget export`: one budget as a standalone ONNX model, or the dense model as a Hugging Face folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from headbudget.commands.common import CliError, budget_arg, existing_dir
from headbudget.engine.names import PRECISION_NAMES


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export", help="export one budget as ONNX, or the dense model as a Hugging Face folder")
    p.add_argument("--model", required=True, type=existing_dir, help="checkpoint folder")
    p.add_argument("--budget", type=budget_arg, default=1.0, help="the budget to export (hf: only 1)")
    p.add_argument("--format", choices=("onnx", "hf"), default="onnx",
                   help="onnx: a plain ONNX Runtime model with only the kept heads; hf: a transformers folder")
    p.add_argument("--precision", choices=PRECISION_NAMES, default="fp32", help="onnx only: weight precision")
    p.add_argument("--out", required=True, type=Path, help="a new (or empty) folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.format == "hf":
        if args.budget != 1.0:
            raise CliError("--format hf holds the dense model only (budget 1): Hugging Face's BERT runs the same "
                           "number of heads in every layer; use --format onnx for a budget")
        if args.precision != "fp32":
            raise CliError("--format hf writes fp32 weights; --precision applies to --format onnx")
        from headbudget.models.hf.export import NOT_CARRIED, export_hf

        hf = export_hf(args.model, args.out)
        how = (" (custom head: load with trust_remote_code=True; --format onnx writes a folder that ONNX runtimes "
               "such as optimum load without custom code)") if hf.remote_code else \
            (f" (standard, no remote code; {hf.added_layers} added layer carries the mean pooling to the first "
             "token)") if hf.added_layers else " (standard, no remote code)"
        print(f"{hf.folder}: {hf.architecture}{how}, {hf.n_parameters / 1e6:.1f} M parameters; the dense model "
              f"(b = 1) only: {' and '.join(NOT_CARRIED)} stay in headbudget (--format onnx exports one budget)")
        return 0
    from headbudget.engine.onnx.export import export_onnx

    rec = export_onnx(args.model, args.budget, args.out, args.precision)
    print(f"{rec.folder}/model.onnx: budget {rec.budget:g}, {rec.heads_kept}/{rec.heads_total} heads "
          f"({' '.join(map(str, rec.heads_per_layer))} per layer), {rec.precision}, {rec.size_bytes / 1e6:.1f} MB; "
          "loads in ONNX Runtime alone or in optimum's ORTModelForSequenceClassification")
    return 0
