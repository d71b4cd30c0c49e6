"""`headbudget importance`: per-head importance of a checkpoint (gradient and masking scores), JSON + heatmap."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from headbudget.commands.common import existing_dir, positive_int


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("importance", help="head importance E|dL/dxi| and masking-ablation scores of a checkpoint")
    p.add_argument("--model", required=True, type=existing_dir,
                   help="checkpoint folder (e.g. a run's stages/dense warm start)")
    p.add_argument("--data", required=True, help="synthetic, a folder with train/test files, or a HF dataset name")
    p.add_argument("--examples", type=positive_int, default=2000, help="training examples for the gradient score")
    p.add_argument("--ablation-examples", type=int, default=500,
                   help="validation examples for the mask-one-head score (0 skips it)")
    p.add_argument("--max-length", type=positive_int, default=None, help="token limit (default: the checkpoint's)")
    p.add_argument("--text-column", default=None)
    p.add_argument("--label-column", default=None)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--out", required=True, type=Path, help="folder for importance.json and importance.png")
    p.set_defaults(func=run)


def _tokenizer_dir(model_dir: Path) -> Path:
    """The model folder if it has a tokenizer, else its run folder (for stages/<stage>), else MiniLM's."""
    from headbudget.models.pretrained import minilm_path

    for folder in (model_dir, model_dir.parent.parent):
        if (folder / "tokenizer.json").is_file():
            return folder
    return minilm_path()


def run(args: argparse.Namespace) -> int:
    import torch

    from headbudget.commands.common import CliError
    from headbudget.experiments.importance import head_importance, importance_heatmap
    from headbudget.experiments.report import align_labels
    from headbudget.models.checkpoint import load_checkpoint
    from headbudget.models.tokenizer import TextEncoder
    from headbudget.training.batches import tokenize
    from headbudget.training.data import load_data

    if args.ablation_examples < 0:
        raise CliError(f"--ablation-examples must be >= 0, got {args.ablation_examples}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, config = load_checkpoint(args.model)
    meta = config.get("data", {})
    ds = load_data(args.data, args.text_column or meta.get("text_column", "text"),
                   args.label_column or meta.get("label_column", "label"), seed=int(config.get("seed", 7)))
    max_length = min(args.max_length or int(config.get("max_length", 128)), model.cfg.max_position)
    encoder = TextEncoder(_tokenizer_dir(args.model), max_length)
    train = tokenize(align_labels(ds, ds.train.take(args.examples), model.cfg.labels), encoder)
    val = (tokenize(align_labels(ds, ds.validation.take(args.ablation_examples), model.cfg.labels), encoder)
           if args.ablation_examples else None)
    imp = head_importance(model.to(device), train, val)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"model": str(args.model), "data": args.data, "dataset": ds.name, "max_length": max_length,
           "n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads, **imp.to_dict()}
    (args.out / "importance.json").write_text(json.dumps(doc, indent=2) + "\n")
    importance_heatmap(imp, args.out / "importance.png", f"{ds.name}: {args.model.name}")
    top = ", ".join(f"L{f // model.cfg.n_heads}H{f % model.cfg.n_heads}" for f in imp.ranking()[:5])
    print(f"{args.out / 'importance.json'}: {imp.n_examples} examples; most important heads: {top}")
    return 0
