"""Re-time a finished ``headbudget compare --scope model`` on this machine, with another budgeted checkpoint of
the same run lineage in place of the one compare trained.

Why: compare trains its baselines (minutes on a GPU, hours on this CPU) and times them where it trained, which
may be a busy machine; a later checkpoint of the same lineage (the same dense warm start, so the same teacher
and the same dedicated small models) should be placed against them on the serving CPU. Latency depends on shapes
and execution plans, not on weight values, so every baseline is timed as a stand-in with its exact architecture
and plans: ``layerdrop`` and ``ffn-half`` cut from the checkpoint as compare cuts them from the dense model, and
``attention-only`` an attention-scope model whose gates reproduce compare.json's heads per layer at every
budget. Accuracies are not re-measured: the baselines' come from compare.json, the checkpoint's from its
sweep.json (same test split, checked by the dense model's accuracy). Everything is timed round-robin in one
process, each compared budget prepacked as a served operating point (commands/compare.py), and placed with
compare's own rule (headbudget/experiments/latency_placement.py).

    python -m lab.compare_retime --model CKPT --compare compare.json --out retime.json
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headbudget.commands.parser import OneLineParser
from headbudget.experiments import baselines
from headbudget.experiments.compare.measure import EngineFactory, engine_factory, measure_latency
from headbudget.experiments.latency_placement import placement
from headbudget.models.checkpoint import load_checkpoint, save_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.tokenizer import TextEncoder, copy_tokenizer
from headbudget.training.batches import tokenize
from headbudget.training.data import load_data
from lab.script_output import add_latency_options, check_latency_options, check_out, write_doc

_META_SKIP = ("model", "format", "format_version", "package_version")


def _save(model: BudgetedClassifier, source: Path, folder: Path, meta: dict[str, Any]) -> Path:
    """``model`` as a checkpoint in ``folder`` with ``source``'s tokenizer and metadata (not its architecture)."""
    if folder.exists():
        shutil.rmtree(folder)
    copy_tokenizer(source, folder)
    return save_checkpoint(model, folder, {k: v for k, v in meta.items() if k not in _META_SKIP})


def attention_scope(model: BudgetedClassifier) -> BudgetedClassifier:
    """``model``'s weights in an attention-scope model (fresh gates), the scope compare's small models and the
    attention-only run have: a whole-model scope would add an If node per feed-forward block to the graph."""
    return baselines.attention_scope_copy(model)


def attention_standin(model: BudgetedClassifier, plans: list[list[int]]) -> BudgetedClassifier:
    """An attention-scope ``model`` whose hard plans at increasing budgets keep ``plans[i][l]`` heads of layer l
    (nested counts): gate logits set so that heads cross in exactly that order."""
    att, cfg = attention_scope(model), model.cfg
    rank, r, prev = np.zeros((cfg.n_layers, cfg.n_heads)), 0.0, [0] * cfg.n_layers
    for counts in [*plans, [cfg.n_heads] * cfg.n_layers]:
        for layer in range(cfg.n_layers):
            for h in range(prev[layer], counts[layer]):
                rank[layer, h], r = r, r + 1
        prev = counts
    with torch.no_grad():  # crossing logit -a/beta (beta equal at init): a larger a crosses earlier
        att.gates.logit.copy_(torch.tensor(-rank / 10.0, dtype=att.gates.logit.dtype))
    return att


def retime(model_dir: Path, compare: dict[str, Any], work: Path, factory: EngineFactory, texts: int,
           repeats: int, seed: str | None = None) -> dict[str, Any]:
    """compare.json's document for one seed with the checkpoint's curve and every latency measured here."""
    seed = seed or sorted(compare["per_seed"])[0]
    results = compare["per_seed"][seed]["results"]
    sweep = json.loads((model_dir / "sweep.json").read_text())
    dense = results["dense@1.00"]["accuracy"]
    if sweep["n_examples"] != compare["n_test"] or abs(sweep["dense_accuracy"] - dense) > 1e-9:
        raise ValueError(f"{model_dir}/sweep.json is not of compare's lineage: {sweep['n_examples']} test texts, "
                         f"dense {sweep['dense_accuracy']:.4f} against {compare['n_test']}, {dense:.4f}")
    model, meta = load_checkpoint(model_dir)  # meta: the checkpoint's config.json
    c = model.cfg
    att_budgets = sorted(r["budget"] for r in results.values() if r["method"] == "attention-only")
    folders = {
        "layerdrop": _save(baselines.drop_top_layers(attention_scope(model), c.n_layers - c.n_layers // 2),
                           model_dir, work / "layerdrop", meta),
        "ffn-half": _save(baselines.keep_neurons(attention_scope(model), np.tile(np.arange(c.intermediate_size // 2),
                                                                                  (c.n_layers, 1))),
                          model_dir, work / "ffn-half", meta),
        "attention-only": _save(attention_standin(model, [results[f"attention-only@{b:.2f}"]["heads_per_layer"]
                                                          for b in att_budgets]), model_dir, work / "attention-only",
                                meta),
    }
    by_budget = {round(p["budget"], 4): p["accuracy_hard"] for p in sweep["points"]}
    curve = sorted({r["budget"] for r in results.values() if r["method"] == "budgeted"})
    missing = [b for b in curve if round(b, 4) not in by_budget]
    if missing:
        raise ValueError(f"{model_dir}/sweep.json has no hard accuracy at budgets {missing}")
    entries = [("dense", 1.0, model_dir)] + [("budgeted", b, model_dir) for b in curve]
    entries += [("attention-only", b, folders["attention-only"]) for b in att_budgets]
    entries += [(m, 1.0, folders[m]) for m in ("layerdrop", "ffn-half")]
    ds = load_data(compare["data"], seed=int(seed))
    test = tokenize(ds.test, TextEncoder(model_dir, meta.get("max_length", c.max_position)))
    lat = measure_latency(entries, test, factory, texts, repeats)
    out: dict[str, dict[str, Any]] = {}
    for method, b, _ in entries:
        key = f"{method}@{b:.2f}"
        acc = by_budget[round(b, 4)] if method == "budgeted" else results[key]["accuracy"]
        out[key] = {"method": method, "budget": b, "accuracy": acc, **lat[(method, b)]}
    doc = {"model": str(model_dir), "compare": compare.get("command"), "seed": seed, "dense_accuracy": dense,
           "latency": {"texts": texts, "repeats": repeats}, "per_seed": {seed: {"results": out}}}
    doc["placement"] = placement(doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lab.compare_retime", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="budgeted checkpoint with a sweep.json")
    p.add_argument("--compare", type=Path, required=True, help="compare.json of a --scope model run")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--work", type=Path, default=None, help="folder for the stand-ins (default: beside --out)")
    add_latency_options(p)
    args = p.parse_args(argv)
    try:
        check_out(args.out)
        check_latency_options(args)
        compare = json.loads(args.compare.read_text())
        if compare.get("scope") != "model":
            raise ValueError(f"{args.compare} is not a --scope model comparison")
        budgets = tuple(compare["budgets"])
        doc = retime(args.model, compare, args.work or args.out.with_suffix(".standins"),
                     engine_factory("onnxruntime", budgets), args.latency_texts, args.latency_repeats)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_doc(doc, args.out, "compare_retime", argv)
    for row in doc["placement"]:
        print(f"{row['method']:>15} b={row['budget']:.2f} {row['latency_ms_mean']:.2f} ms acc {100 * row['accuracy_mean']:.2f}"
              f"  budgeted there {100 * row['budgeted_accuracy_mean']:.2f}  diff {100 * row['difference_mean']:+.2f}"
              f"  met {row['met']}" if row["n_reached"] else f"{row['method']:>15} b={row['budget']:.2f} not reached")
    return 0


if __name__ == "__main__":
    sys.exit(main())
