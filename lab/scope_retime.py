"""Place a whole-model checkpoint against an attention-only one by measured latency, from their sweeps alone.

The goal: the whole-model checkpoint should be more accurate than the attention-only checkpoint wherever both
reach the same latency. The sweeps are committed and the weights are not (checkpoints are 43 MB and stay where
they were trained), so each side is rebuilt as a timing stand-in from its sweep (lab/standin.py: the sweep's own
plans at every budget, checked). Every swept budget of both is timed round-robin in one process with
compare's engine options (each budget prepacked, as a served operating point: experiments/compare/measure.py, engine_factory),
and each attention-only budget is placed on the whole-model curve with compare's rule
(headbudget/experiments/latency_placement.py: linear in latency between the two bracketing budgets, no
extrapolation).
Accuracies are the sweeps' hard accuracies on the same test split (checked). One ``--pair`` per seed; the
placement aggregates over them.

    python -m lab.scope_retime --exits 3 --out retime.json \\
        --pair 7 docs/results/ag_news/model/sweep.json docs/results/ag_news/attention-kept-recipe/sweep.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser
from headbudget.experiments.compare.measure import engine_factory, measure_latency
from headbudget.experiments.latency_placement import placement
from headbudget.models.config import parse_exits
from headbudget.models.tokenizer import TextEncoder
from headbudget.training.batches import tokenize
from headbudget.training.data import load_data
from lab import standin
from lab.script_output import add_latency_options, check_latency_options, check_out, write_doc

METHODS = ("budgeted", "attention-only")  # latency_placement's names of the whole-model and attention-only sides


def _sweeps(model_path: Path, attention_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both sweeps, refused unless they are a whole-model and an attention-scope sweep of one test split."""
    model, att = standin.read_sweep(model_path), standin.read_sweep(attention_path)
    if model.get("scope") != "model" or att.get("scope", "attention") != "attention":
        raise ValueError(f"expected a whole-model sweep then an attention-scope one: {model_path} is "
                         f"{model.get('scope', 'attention')}, {attention_path} is {att.get('scope', 'attention')}")
    split = [(s["dataset"], s.get("split"), s.get("n_examples")) for s in (model, att)]
    if split[0] != split[1]:
        raise ValueError(f"{model_path} and {attention_path} are not of one test split: "
                         + " against ".join("/".join(str(x) for x in t) for t in split))
    return model, att


def seed_results(model_sweep: dict[str, Any], att_sweep: dict[str, Any],
                 lat: dict[tuple[str, float], dict[str, float]]) -> dict[str, dict[str, Any]]:
    """One seed's results in compare's format: method@budget -> budget, accuracy (hard), latency."""
    out: dict[str, dict[str, Any]] = {}
    for method, sweep in zip(METHODS, (model_sweep, att_sweep), strict=True):
        for p in sweep["points"]:
            b = float(p["budget"])
            out[f"{method}@{b:.2f}"] = {"method": method, "budget": b, "accuracy": p["accuracy_hard"],
                                        **lat[(method, b)]}
    return out


def retime(pairs: list[tuple[str, Path, Path]], exits: tuple[int, ...] | None, base: str, work: Path,
           texts: int, repeats: int) -> dict[str, Any]:
    """The document: per seed, both curves with latencies measured here, and the placement over the seeds."""
    sweeps = [_sweeps(model_path, att_path) for _, model_path, att_path in pairs]  # all checked before any work
    budgets = sorted({float(p["budget"]) for pair in sweeps for sweep in pair for p in sweep["points"]})
    factory = engine_factory("onnxruntime", tuple(budgets))  # every swept budget prepacked, as compare does
    per_seed: dict[str, Any] = {}
    for (seed, model_path, att_path), (model_sweep, att_sweep) in zip(pairs, sweeps, strict=True):
        folders: dict[str, Path] = {}
        for method, sweep, path in zip(METHODS, (model_sweep, att_sweep), (model_path, att_path), strict=True):
            model = standin.build(sweep, base, exits if method == "budgeted" else None)
            folders[method] = standin.write(model, path, base, work / f"{seed}-{method}", 128)
        ds = load_data(model_sweep["dataset"])  # the test split does not depend on the seed
        test = tokenize(ds.test, TextEncoder(folders["budgeted"], 128))
        entries = [(method, float(p["budget"]), folders[method])
                   for method, sweep in zip(METHODS, (model_sweep, att_sweep), strict=True)
                   for p in sweep["points"]]
        lat = measure_latency(entries, test, factory, texts, repeats)
        per_seed[seed] = {"model_sweep": str(model_path), "attention_sweep": str(att_path),
                          "dense_accuracy": {"budgeted": model_sweep["dense_accuracy"],
                                             "attention-only": att_sweep["dense_accuracy"]},
                          "results": seed_results(model_sweep, att_sweep, lat)}
    doc: dict[str, Any] = {"latency": {"texts": texts, "repeats": repeats, "engine": "onnxruntime fp32, one thread, "
                                       "every budget prepacked, round-robin in one process"},
                           "per_seed": per_seed}
    doc["placement"] = [row for row in placement(doc) if row["method"] == "attention-only"]
    return doc


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lab.scope_retime", description=__doc__.split("\n")[0])
    p.add_argument("--pair", nargs=3, action="append", required=True, metavar=("SEED", "MODEL_SWEEP", "ATTENTION_SWEEP"),
                   help="one seed's whole-model sweep.json and attention-scope sweep.json (repeat per seed)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--exits", default=None, help="the whole-model runs' exits, for sweeps that do not record them")
    p.add_argument("--base", default="minilm", help="the base both were trained from")
    p.add_argument("--work", type=Path, default=None, help="folder for the stand-ins (default: beside --out)")
    add_latency_options(p)
    args = p.parse_args(argv)
    try:
        check_out(args.out)
        check_latency_options(args)
        exits = None if args.exits is None else parse_exits(args.exits)  # None: the sweeps' own
        pairs = [(seed, Path(m), Path(a)) for seed, m, a in args.pair]
        doc = retime(pairs, exits, args.base, args.work or args.out.with_suffix(".standins"), args.latency_texts,
                     args.latency_repeats)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_doc(doc, args.out, "scope_retime", argv)
    for row in doc["placement"]:
        diff = row["difference_mean"]
        print(f"attention-only b={row['budget']:.2f} {row['latency_ms_mean']:.2f} ms acc {100 * row['accuracy_mean']:.2f}"
              + (f"  whole-model there {100 * row['budgeted_accuracy_mean']:.2f}  diff {100 * diff:+.2f}"
                 f"  met {row['met']}" if row["n_reached"] else "  not reached"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
