"""`headbudget predict`: classify one text at a budget with the reference model."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from headbudget.commands.common import CliError, budget_arg, existing_dir, refuse_standin


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("predict", help="classify a text at a budget")
    p.add_argument("--model", required=True, type=existing_dir, help="checkpoint folder")
    p.add_argument("--budget", type=budget_arg, default=1.0, help="compute budget in [0.1, 1], as the API takes it")
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
    refuse_standin(config, args.model)
    encoder = TextEncoder(args.model, int(config.get("max_length", model.cfg.max_position)))
    enc = encoder.encode([args.text])
    ids, mask = enc.padded(encoder.pad_id)
    if not model_type(model.cfg.model_type).static_plans:
        return _predict_adaptive(model, ids, mask, args.budget, bool(enc.truncated[0]))
    with torch.no_grad():
        logits = model.hard_logits(torch.from_numpy(ids), torch.from_numpy(mask), args.budget)[0]
    probs = torch.softmax(logits, -1).tolist()
    labels = model.cfg.labels
    best = max(range(len(labels)), key=lambda i: probs[i])
    print(f"label: {labels[best]}")
    print("scores: " + ", ".join(f"{name}={p:.4f}" for name, p in zip(labels, probs, strict=True)))
    plan, cfg = model.gates.policy().plan(args.budget), model.cfg
    per_layer = " ".join(map(str, plan.heads))
    kept = f"heads: {plan.heads_active}/{plan.heads_total} (per layer: {per_layer})"
    if plan.ffn is not None:
        kept += f"; neurons: {sum(plan.ffn)}/{cfg.n_layers * cfg.intermediate_size}"
    if plan.depth is not None:
        kept += f"; stops after layer {plan.depth} of {cfg.n_layers}"
    print(f"{kept}; budget {args.budget:g}{'; input truncated' if enc.truncated[0] else ''}")
    return 0


def _predict_adaptive(model, ids, mask, budget: float, truncated: bool) -> int:  # type: ignore[no-untyped-def]
    """An adaptive type picks its own heads (BudgetFormer: capped by the budget), spans or dimensions."""
    import torch

    usage_line = _USAGE_LINES[model.cfg.model_type]
    with torch.no_grad():
        out = model.forward_adaptive(torch.from_numpy(ids), torch.from_numpy(mask), cap=budget)
    probs = torch.softmax(out.logits[0], -1).tolist()
    labels = model.cfg.labels
    best = max(range(len(labels)), key=lambda i: probs[i])
    print(f"label: {labels[best]}")
    print("scores: " + ", ".join(f"{name}={p:.4f}" for name, p in zip(labels, probs, strict=True)))
    usage = {k: v[0] for k, v in out.usage.items()}  # (L, ...) for this one text
    print(usage_line(model.cfg, usage, budget) + ("; input truncated" if truncated else ""))
    return 0


def _heads_line(cfg: Any, usage: dict[str, Any], budget: float) -> str:
    heads = usage["heads"].long()  # (L,)
    per_layer = " ".join(map(str, heads.tolist()))
    return f"heads: {int(heads.sum())}/{cfg.total_heads} (per layer: {per_layer}); cap {budget:g}"


def _span_line(cfg: Any, usage: dict[str, Any], budget: float) -> str:
    return f"mean span: {float(usage['span'].mean()):.1f} tokens"


def _dims_line(cfg: Any, usage: dict[str, Any], budget: float) -> str:
    full = int((usage["dims"] == cfg.head_dim).sum())
    return (f"heads at full dimension: {full}/{cfg.total_heads}; mean dimension "
            f"{float(usage['dims'].float().mean()):.1f}/{cfg.head_dim}")


# What each adaptive type used on the text, by model_type: (config, usage (L, ...), budget) -> one line.
_USAGE_LINES: dict[str, Callable[[Any, dict[str, Any], float], str]] = {
    "budgetformer": _heads_line, "span": _span_line, "adaattention": _dims_line}
