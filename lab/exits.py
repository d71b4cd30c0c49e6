"""Early exits on a finished whole-model checkpoint: would skipping the top layers beat the width plans?

Layer skipping, measured before it was built. On the frozen checkpoint, one linear head per
exit depth d < L (below the first exit, for a checkpoint trained with exits) reads the pooled output of layer d
(the model's own pooling); it is fitted on training-split features taken at every width budget in ``--widths``
at once, so that one head serves every width, as a shipped exit would. An exit plan (d, w) runs the first d
layers of the checkpoint's own plan at width budget w: it stays nested (a larger d or w keeps every unit a
smaller one keeps). Its cost is those layers' multiply-adds at the
reference length over the dense model's; its latency is timed with the engine's own graph builder (the plan cut
to d layers, prepacked, one thread), round-robin with the checkpoint's own budgets in one process, and placed on
the checkpoint's curve at equal latency with compare's rule (headbudget/experiments/latency_placement.py).

Why linear heads on frozen layers: they need no backward pass through the encoder (minutes on a CPU), so the
result says what an exit gets *without* retraining the shared weights; training with exits can only add to it.

    python -m lab.exits --model CKPT --data ../shared/data/ag_news --out exits.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headbudget.commands.parser import OneLineParser
from headbudget.engine.factory import load_engine
from headbudget.engine.onnx.backend import OnnxEngine
from headbudget.engine.types import EngineOptions
from headbudget.experiments.latency_placement import at_latency
from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.plan import ExecutionPlan, Shape
from headbudget.models.tokenizer import TextEncoder
from headbudget.training.batches import TokenizedSplit, batches, order_for_eval, tokenize
from headbudget.training.data import load_data
from lab.script_output import add_latency_options, check_latency_options, check_out, write_doc

WEIGHT_DECAYS = (1e-4, 1e-3, 1e-2)  # chosen per head on the validation split


@torch.no_grad()
def layer_features(model: BudgetedClassifier, data: TokenizedSplit, gate: torch.Tensor | None) -> np.ndarray:
    """Every layer's pooled output under ``gate`` (L, U) or dense, (N, L, D) in the split's order."""
    model.eval()
    out = []
    for ids, mask, _ in batches(data, 128, torch.device("cpu")):
        _, states = model.logits_and_states(ids, mask, gate)
        out.append(torch.stack([model.pool(s, mask) for s in states], 1))  # (B, L, D)
    feats = torch.cat(out).numpy()
    result = np.empty_like(feats)
    result[order_for_eval(data)] = feats
    return result


@torch.no_grad()
def own_logits(model: BudgetedClassifier, feats: np.ndarray, depth: int | None) -> np.ndarray:
    """What the checkpoint answers from its pooled layer outputs (N, L, D): the classifier on the top layer, or
    the trained exit head of a plan that stops at layer ``depth``.  (N, C)"""
    d = depth or model.cfg.n_layers
    return model.answer(torch.from_numpy(feats[:, d - 1])[:, None], torch.ones(len(feats), 1), d).numpy()


def _logistic(x: torch.Tensor, y: torch.Tensor, n_labels: int, wd: float) -> torch.nn.Linear:
    """Multinomial logistic regression with an L2 penalty ``wd``, fitted by L-BFGS in float64."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(x.shape[1], n_labels).double()
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(x.double()), y) + wd * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lin


def fit_head(x: np.ndarray, y: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
             n_labels: int) -> tuple[np.ndarray, np.ndarray, float]:
    """A linear head (W (C, D), b (C,)) on standardized features, L2 chosen on validation; returns W, b, wd."""
    mu, sd = x.mean(0), x.std(0) + 1e-6
    xt, yt = torch.from_numpy((x - mu) / sd), torch.from_numpy(y)
    best: tuple[float, np.ndarray, np.ndarray, float] = (-1.0, np.zeros(0), np.zeros(0), 0.0)
    for wd in WEIGHT_DECAYS:
        lin = _logistic(xt, yt, n_labels, wd)
        w = lin.weight.detach().numpy() / sd  # fold the standardization in: W' x + b' = W (x - mu) / sd + b
        b = lin.bias.detach().numpy() - w @ mu
        acc = float(((x_val @ w.T + b).argmax(1) == y_val).mean())
        if acc > best[0]:
            best = (acc, w, b, wd)
    return best[1], best[2], best[3]


def exit_plan(plan: ExecutionPlan, depth: int) -> ExecutionPlan:
    """``plan`` cut to its first ``depth`` layers (what an exit at layer ``depth`` runs)."""
    return ExecutionPlan(heads=plan.heads[:depth], n_heads=plan.n_heads,
                         ffn=None if plan.ffn is None else plan.ffn[:depth])


def exit_cost(plan: ExecutionPlan, depth: int, shape: Shape, n_tokens: int) -> float:
    """Multiply-adds of the first ``depth`` layers of ``plan`` (and a head) over the dense model's."""
    return exit_plan(plan, depth).cost(shape, n_tokens).total_macs / plan.cost(shape, n_tokens).total_macs_dense


def time_plans(model_dir: Path, plans: dict[str, ExecutionPlan], test: TokenizedSplit, n_texts: int,
               repeats: int) -> dict[str, float]:
    """Median (over passes) mean per-text ms, batch 1, fp32, one thread, each plan in its own prepacked session."""
    engine = load_engine(model_dir, EngineOptions(prepacked_budgets=()))
    assert isinstance(engine, OnnxEngine)  # the default backend: its sessions run any plan
    runners = {name: engine._whole(plan, prepack=True) for name, plan in plans.items()}  # noqa: SLF001
    inputs = [(np.asarray([ids], np.int64), np.ones((1, len(ids)), np.int32)) for ids in test.ids[:n_texts]]
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeats + 1):  # the first pass warms every session up and is dropped
        for name, runner in runners.items():
            t0 = time.perf_counter()
            for ids, mask in inputs:
                runner.run({"input_ids": runner.value(ids), "attention_mask": runner.value(mask)})
            times[name].append(1000.0 * (time.perf_counter() - t0) / max(1, len(inputs)))
    return {name: float(np.median(t[1:])) for name, t in times.items()}


def cross_fitted(correct: dict[str, tuple[float, np.ndarray]], budget: float, exits: bool) -> dict[str, Any]:
    """The plan costing at most what ``own@budget`` costs that is most accurate on one half of the test texts,
    scored on the other half, both ways round: what a schedule chosen on a held-out set of that size would get,
    without scoring any text with a choice it made. ``exits`` False: the checkpoint's own plans only (the
    selection effect alone)."""
    # Within the multiply-adds of the checkpoint's own plan at the budget (which counts the classifier too).
    limit = correct[f"own@{budget:.2f}"][0] + 1e-9
    fit = sorted(k for k, (cost, _) in correct.items() if cost <= limit and (exits or k.startswith("own@")))
    n = len(correct[fit[0]][1])
    perm = np.random.default_rng(0).permutation(n)
    halves = (perm[: n // 2], perm[n // 2:])
    picks, hits = [], 0
    for pick_on, score_on in (halves, halves[::-1]):
        best = max(fit, key=lambda k: float(correct[k][1][pick_on].mean()))
        picks.append(best)
        hits += int(correct[best][1][score_on].sum())
    return {"picks": picks, "accuracy": hits / n}


def _probe_exits(depths: range, widths: list[float], feats: dict[float, dict[str, np.ndarray]], split: dict[str, Any],
                 correct: dict[str, tuple[float, np.ndarray]], policy: Any, shape: Shape, n_ref: int,
                 n_labels: int) -> list[dict[str, Any]]:
    """One linear head per depth, fitted on every width's features there; a row per (depth, width), and each
    plan's per-text correctness added to ``correct``."""
    rows: list[dict[str, Any]] = []
    for depth in depths:
        x = np.concatenate([feats[w]["train"][:, depth - 1] for w in widths])
        y = np.concatenate([split["train"].labels] * len(widths))
        xv = np.concatenate([feats[w]["validation"][:, depth - 1] for w in widths])
        yv = np.concatenate([split["validation"].labels] * len(widths))
        w_head, b_head, wd = fit_head(x, y, xv, yv, n_labels)
        for w in widths:
            hit = {name: (feats[w][name][:, depth - 1] @ w_head.T + b_head).argmax(1) == split[name].labels
                   for name in ("validation", "test")}
            cost = exit_cost(policy.plan(w), depth, shape, n_ref)
            correct[f"exit{depth}@{w:.2f}"] = (cost, hit["test"])
            rows.append({"depth": depth, "width_budget": w, "cost": cost, "weight_decay": wd,
                         "accuracy_val": float(hit["validation"].mean()), "accuracy": float(hit["test"].mean())})
    return rows


def measure(model_dir: Path, data: str, widths: list[float], budgets: list[float], n_texts: int,
            repeats: int) -> dict[str, Any]:
    """The exit plans' cost, accuracy and latency against the checkpoint's own budgets (one JSON document)."""
    model, meta = load_checkpoint(model_dir)
    cfg, policy = model.cfg, model.gates.policy()
    if not cfg.gate.scope_spec.exits or cfg.pooler != "none":
        raise ValueError(f"{model_dir}: exits are measured on whole-model checkpoints without a pooler layer")
    # A checkpoint with trained exits is probed only below its first one: above it, its own plans already stop
    # at a trained exit, and a probe there would measure the two mixed.
    depths = range(1, min(cfg.gate.exits) if cfg.gate.exits else cfg.n_layers)
    if not depths:
        raise ValueError(f"{model_dir}: no layer below its first exit (layer {min(cfg.gate.exits)}) to probe")
    run = json.loads((model_dir / "run.json").read_text()) if (model_dir / "run.json").is_file() else {}
    ds = load_data(data, seed=int(run.get("seed", 7)))
    enc = TextEncoder(model_dir, meta.get("max_length", cfg.max_position))
    split = {name: tokenize(ds.split(name), enc) for name in ("train", "validation", "test")}
    shape, n_ref = Shape.of(cfg), cfg.gate.ref_length
    feats: dict[float, dict[str, np.ndarray]] = {}
    own: dict[float, dict[str, float]] = {}
    correct: dict[str, tuple[float, np.ndarray]] = {}  # plan name -> (cost, per-test-text correctness)
    for b in sorted(set(widths) | set(budgets)):
        gate = None if b >= 1.0 else model.hard_gates(b)
        names = ("train", "validation", "test") if b in widths else ("validation", "test")  # heads fit on widths
        feats[b] = {name: layer_features(model, split[name], gate) for name in names}
        hit = {name: own_logits(model, feats[b][name], policy.plan(b).depth).argmax(1) == split[name].labels
               for name in ("validation", "test")}
        own[b] = {name: float(h.mean()) for name, h in hit.items()}
        if b in budgets:
            correct[f"own@{b:.2f}"] = (policy.plan(b).cost(shape, n_ref).ratio, hit["test"])
    rows = _probe_exits(depths, widths, feats, split, correct, policy, shape, n_ref, cfg.n_labels)
    plans = {f"own@{b:.2f}": policy.plan(b) for b in budgets}
    plans |= {f"exit{r['depth']}@{r['width_budget']:.2f}": exit_plan(policy.plan(r["width_budget"]), r["depth"])
              for r in rows}
    lat = time_plans(model_dir, plans, split["test"], n_texts, repeats)
    curve = [{"budget": b, "latency_ms": lat[f"own@{b:.2f}"], "accuracy": own[b]["test"]} for b in budgets]
    for r in rows:
        r["latency_ms"] = lat[f"exit{r['depth']}@{r['width_budget']:.2f}"]
        there = at_latency([(c["budget"], c["latency_ms"], c["accuracy"]) for c in curve], r["latency_ms"])
        r["own_accuracy_at_latency"] = None if there is None else there["accuracy"]
    return {"model": str(model_dir), "data": data, "n_test": len(split["test"]), "widths": widths,
            "own": [{**c, "cost": correct[f"own@{c['budget']:.2f}"][0],
                     "accuracy_val": own[c["budget"]]["validation"]} for c in curve],
            "exits": rows, "schedules": [{"budget": b, "own": own[b]["test"],
                                          "own_only": cross_fitted(correct, b, exits=False),
                                          "with_exits": cross_fitted(correct, b, exits=True)} for b in budgets],
            "latency": {"texts": n_texts, "repeats": repeats, "precision": "fp32", "threads": 1}}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lab.exits", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="whole-model (--scope model) budgeted checkpoint")
    p.add_argument("--data", required=True, help="the dataset it was trained on (folder or name)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--widths", default="0.5,0.75,0.9,1.0", help="width budgets the exit plans run")
    p.add_argument("--budgets", default="0.25,0.3,0.35,0.4,0.45,0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,1.0",
                   help="the checkpoint's own budgets to place the exits against")
    add_latency_options(p)
    args = p.parse_args(argv)
    try:
        check_out(args.out)
        check_latency_options(args)
        try:
            widths = [float(w) for w in args.widths.split(",")]
            budgets = [float(b) for b in args.budgets.split(",")]
        except ValueError:
            raise ValueError(f"--widths and --budgets take comma-separated numbers, got {args.widths!r}, "
                             f"{args.budgets!r}") from None
        if not all(0.0 < b <= 1.0 for b in widths + budgets):
            raise ValueError("--widths and --budgets take budgets in (0, 1]")
        doc = measure(args.model, args.data, widths, budgets, args.latency_texts, args.latency_repeats)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_doc(doc, args.out, "exits", argv)
    for r in doc["exits"]:
        there = r["own_accuracy_at_latency"]
        print(f"exit {r['depth']} width {r['width_budget']:.2f}: cost {r['cost']:.3f} {r['latency_ms']:.2f} ms "
              f"acc {100 * r['accuracy']:.2f} (val {100 * r['accuracy_val']:.2f})  own curve there "
              + ("not reached" if there is None else f"{100 * there:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
