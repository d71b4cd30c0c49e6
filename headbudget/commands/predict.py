"""`headbudget predict`: classify one text at a budget with the reference model."""

from __future__ import annotations

import argparse

from headbudget.commands.common import CliError, budget_arg, existing_dir


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("predict", help="classify a text at a budget")
    p.add_argument("--model", required=True, type=existing_dir, help="checkpoint folder")
    p.add_argument("--budget", type=budget_arg, default=1.0, help="compute budget in [0, 1]")
    p.add_argument("text", help="the text to classify")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from headbudget.models.checkpoint import load_checkpoint
    from headbudget.models.model_types import model_type
    from headbudget.models.tokenizer import TextEncoder

    if not args.text.strip():
        raise CliError("text is empty")
    model, config = load_checkpoint(args.model)
    encoder = TextEncoder(args.model, int(config.get("max_length", model.cfg.max_position)))
    enc = encoder.encode([args.text])
    ids, mask = enc.padded(encoder.pad_id)
    if not model_type(model.cfg.model_type).static_plans:
        return _predict_adaptive(model, ids, mask, args.budget, bool(enc.truncated[0]))
    head_mask = model.gates.hard_mask(args.budget)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids), torch.from_numpy(mask), model.hard_gates(args.budget))[0]
    probs = torch.softmax(logits, -1).tolist()
    labels = model.cfg.labels
    best = max(range(len(labels)), key=lambda i: probs[i])
    print(f"label: {labels[best]}")
    print("scores: " + ", ".join(f"{name}={p:.4f}" for name, p in zip(labels, probs, strict=True)))
    per_layer = " ".join(str(int(n)) for n in head_mask.sum(1))
    print(f"heads: {int(head_mask.sum())}/{head_mask.size} (per layer: {per_layer}); "
          f"budget {args.budget:g}{'; input truncated' if enc.truncated[0] else ''}")
    return 0


def _predict_adaptive(model, ids, mask, budget: float, truncated: bool) -> int:  # type: ignore[no-untyped-def]
    """An adaptive type picks its own heads (BudgetFormer: capped by the budget), spans or dimensions."""
    import torch

    from headbudget.models.budgetformer import BudgetFormerClassifier

    if isinstance(model, BudgetFormerClassifier):
        model.set_budget_cap(budget)
    with torch.no_grad():
        probs = torch.softmax(model(torch.from_numpy(ids), torch.from_numpy(mask))[0], -1).tolist()
    labels = model.cfg.labels
    best = max(range(len(labels)), key=lambda i: probs[i])
    print(f"label: {labels[best]}")
    print("scores: " + ", ".join(f"{name}={p:.4f}" for name, p in zip(labels, probs, strict=True)))
    usage = {k: v[0] for k, v in model.usage().items()}  # (L, ...) for this one text
    note = "; input truncated" if truncated else ""
    if "heads" in usage:
        heads = usage["heads"].long()
        print(f"heads: {int(heads.sum())}/{model.cfg.total_heads} (per layer: {' '.join(map(str, heads.tolist()))}); "
              f"cap {budget:g}{note}")
    elif "dims" in usage:
        full = int((usage["dims"] == model.cfg.head_dim).sum())
        print(f"heads at full dimension: {full}/{model.cfg.total_heads}; mean dimension "
              f"{float(usage['dims'].float().mean()):.1f}/{model.cfg.head_dim}{note}")
    else:
        print(f"mean span: {float(usage['span'].mean()):.1f} tokens{note}")
    return 0
