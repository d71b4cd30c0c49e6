"""A timing stand-in of a budgeted checkpoint, rebuilt from its sweep.json alone: the base model's weights with
gates that reproduce the sweep's unit ranking, so that every budget runs the checkpoint's execution plan.

Why: checkpoints are not in git (43 MB of weights without the frozen word embeddings), and a run trained on
another machine may come back as its sweep alone. Latency depends on the plans (heads and neurons per layer,
the depth a plan stops at), not on weight values, and a sweep records the whole ranking (``head_order``), so
the committed sweep is enough to time a checkpoint again, or a run whose weights stayed where it was trained.
``compare_retime`` already times its baselines this way. The stand-in's
answers are the base's, not the checkpoint's: its config says so (``standin``), ``headbudget serve`` refuses
it, and accuracies come from the sweep. Every point of the sweep is checked: the stand-in's plan at each
budget must equal the sweep's heads and neurons per layer and layers run, or nothing is written.

    python -m lab.standin --sweep docs/results/ag_news/model/sweep.json --exits 3 \
        --out checkpoints/ag_news-model-exits-standin

Where the checkpoint is at hand, ``--time-against CKPT --report R.json`` times the two round-robin in one
process: the way to check that a stand-in runs at its checkpoint's speed.
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
from headbudget.experiments.compare.measure import engine_factory, measure_latency
from headbudget.models.checkpoint import save_checkpoint
from headbudget.models.checkpoint_meta import STANDIN, CheckpointError, read_config, standin_of
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import GateConfig, parse_exits
from headbudget.models.plan import ExecutionPlan
from headbudget.models.tokenizer import TextEncoder, copy_tokenizer
from headbudget.training.batches import tokenize
from headbudget.training.data import load_data
from headbudget.training.trainer import build_base, tokenizer_folder
from lab.script_output import add_latency_options, check_latency_options, check_out, write_doc

CHECK_BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.1)
STANDIN_NOTE = "timing stand-in: the base's weights with the sweep's unit ranking; its answers are not the checkpoint's"
SWEEP_KEYS = ("dataset", "n_layers", "n_heads", "head_order", "points")


def read_sweep(path: Path) -> dict[str, Any]:
    """A sweep.json, refused with one line unless it holds what a stand-in is built from."""
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(doc, dict) or any(k not in doc for k in SWEEP_KEYS):
        raise ValueError(f"{path}: not a sweep.json (it needs {', '.join(SWEEP_KEYS)})")
    return doc


def gate_of(sweep: dict[str, Any], exits: tuple[int, ...] | None) -> GateConfig:
    """The gate configuration a sweep was made with; ``exits`` where the sweep predates recording them."""
    recorded = sweep.get("exits")
    if exits is not None and recorded is not None and tuple(recorded) != exits:
        raise ValueError(f"--exits {list(exits)} differs from the sweep's exits {recorded}")
    chosen = tuple(recorded) if recorded is not None else (exits or ())
    if sweep.get("scope", "attention") == "attention":
        return GateConfig(structural=bool(sweep.get("structural", False)), exits=chosen)
    return GateConfig(scope="model", ffn_group=int(sweep["ffn_group"]), ref_length=int(sweep["ref_length"]),
                      exits=chosen)


def set_ranking(model: BudgetedClassifier, order: np.ndarray) -> None:
    """Gate logits whose crossing budgets rank the units exactly as ``order`` (flat l * U + u, first = earliest).

    Crossing logit -a / beta (models/budget.py); with beta left at its init (equal for all units), a = -beta *
    rank / 10 gives crossing logits rank / 10: distinct, so no tie falls back to the (layer, unit) order.
    """
    shape = model.gates.logit.shape  # (L, U)
    if sorted(order.tolist()) != list(range(int(np.prod(shape)))):
        raise ValueError(f"head_order is not a ranking of the model's {int(np.prod(shape))} gate units")
    rank = np.empty(order.size, dtype=np.float64)
    rank[order] = np.arange(order.size)
    with torch.no_grad():
        beta = torch.nn.functional.softplus(model.gates.raw_beta.double())
        a = -beta * torch.from_numpy(rank.reshape(shape)) / 10.0
        model.gates.logit.copy_(a.to(model.gates.logit.dtype))


def plan_record(plan: ExecutionPlan) -> dict[str, Any]:
    """A plan in the sweep's terms: heads (and neurons) per layer, and the layers run."""
    out: dict[str, Any] = {"heads_per_layer": list(plan.heads)}
    if plan.ffn is not None:
        out["neurons_per_layer"] = list(plan.ffn)
        out["layers_run"] = plan.layers_run
    return out


def check_plans(model: BudgetedClassifier, sweep: dict[str, Any]) -> None:
    """Raise unless the model's plan at every swept budget is the sweep's."""
    policy = model.gates.policy()
    for point in sweep["points"]:
        ours = plan_record(policy.plan(float(point["budget"])))
        theirs = {k: point[k] for k in ours if k in point}
        if {k: ours[k] for k in theirs} != theirs:
            raise ValueError(f"b={point['budget']:.2f}: the stand-in's plan {ours} differs from the sweep's {theirs}"
                             + ("" if sweep.get("exits") is not None else "; was it trained with --exits?"))


def build(sweep: dict[str, Any], base: str, exits: tuple[int, ...] | None, seed: int = 0,
          max_length: int = 128) -> BudgetedClassifier:
    """The stand-in model of ``sweep``'s checkpoint on ``base`` (checked at every swept budget)."""
    gate = gate_of(sweep, exits)
    labels = load_data(sweep["dataset"]).labels
    model = build_base(base, labels, gate, seed, max_length).model
    cfg = model.cfg
    if (cfg.n_layers, cfg.n_heads) != (sweep["n_layers"], sweep["n_heads"]):
        raise ValueError(f"base {base!r} has {cfg.n_layers} layers x {cfg.n_heads} heads, the sweep "
                         f"{sweep['n_layers']} x {sweep['n_heads']}")
    set_ranking(model, np.asarray(sweep["head_order"], dtype=np.int64))
    check_plans(model, sweep)
    return model.eval()


def _is_standin(folder: Path) -> bool:
    try:
        return standin_of(read_config(folder)) is not None
    except CheckpointError:
        return False


def write(model: BudgetedClassifier, sweep_path: Path, base: str, out: Path, max_length: int) -> Path:
    """Save the stand-in as a checkpoint folder (config marked ``standin``; no sweep.json, so nothing serves the
    real checkpoint's accuracy beside the base's answers)."""
    if out.exists():
        if not _is_standin(out):  # "replaced if present" must never take a real checkpoint or any other folder
            raise ValueError(f"--out {out} exists and is not a stand-in: choose a new folder")
        shutil.rmtree(out)
    meta = {"name": out.name, "model_type": "budgeted", "max_length": max_length, "base": base,
            STANDIN: {"sweep": str(sweep_path), "note": STANDIN_NOTE}}
    save_checkpoint(model, out, meta)
    copy_tokenizer(tokenizer_folder(base), out)
    return out


def time_against(checkpoint: Path, folder: Path, dataset: str, texts: int, repeats: int,
                 standin_first: bool = False) -> dict[str, Any]:
    """The stand-in and the checkpoint it stands for, timed round-robin in one process at CHECK_BUDGETS (every
    budget prepacked, compare's protocol): the evidence that a stand-in's latency is its checkpoint's."""
    test = tokenize(load_data(dataset).test, TextEncoder(checkpoint, 128))
    pair = [("standin", folder), ("checkpoint", checkpoint)]
    entries = [(name, b, f) for b in CHECK_BUDGETS for name, f in (pair if standin_first else pair[::-1])]
    lat = measure_latency(entries, test, engine_factory("onnxruntime", CHECK_BUDGETS), texts, repeats)
    rows = [{"budget": b, "checkpoint_ms": lat[("checkpoint", b)]["latency_ms"],
             "standin_ms": lat[("standin", b)]["latency_ms"],
             "standin_over_checkpoint": lat[("standin", b)]["latency_ms"] / lat[("checkpoint", b)]["latency_ms"]}
            for b in CHECK_BUDGETS]
    return {"checkpoint": str(checkpoint), "standin": str(folder), "standin_first": standin_first,
            "latency": {"texts": texts, "repeats": repeats}, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lab.standin", description=__doc__.split("\n")[0])
    p.add_argument("--sweep", type=Path, required=True, help="the checkpoint's sweep.json")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write (replaced if present)")
    p.add_argument("--base", default="minilm", help="the base it was trained from: minilm, tiny or a folder")
    p.add_argument("--exits", default=None, help="exit depths, e.g. 3, for a sweep that does not record them")
    p.add_argument("--max-length", type=int, default=128, help="the checkpoint's token limit (config.json)")
    p.add_argument("--time-against", type=Path, default=None, metavar="CHECKPOINT",
                   help="the checkpoint the sweep is of, where there is one: time both, one process")
    p.add_argument("--report", type=Path, default=None, help="JSON file for --time-against's figures")
    p.add_argument("--standin-first", action="store_true", help="--time-against: the stand-in runs first per budget")
    add_latency_options(p, repeats=7)
    a = p.parse_args(argv)
    if (a.time_against is None) != (a.report is None):
        print("error: --time-against and --report go together", file=sys.stderr)
        return 2
    try:
        exits = None if a.exits is None else parse_exits(a.exits)  # None: the sweep's own
        check_latency_options(a)
        sweep = read_sweep(a.sweep)
        model = build(sweep, a.base, exits, max_length=a.max_length)
        if a.report is not None:
            check_out(a.report)
        folder = write(model, a.sweep, a.base, a.out, a.max_length)
        print(f"{folder}: {len(sweep['points'])} plans as in {a.sweep}")
        if a.time_against is not None and a.report is not None:
            doc = time_against(a.time_against, folder, sweep["dataset"], a.latency_texts, a.latency_repeats,
                               a.standin_first)
            write_doc(doc, a.report, "standin", argv)
            for r in doc["rows"]:
                print(f"b={r['budget']:.2f} checkpoint {r['checkpoint_ms']:.3f} ms, stand-in {r['standin_ms']:.3f} ms, "
                      f"stand-in / checkpoint {r['standin_over_checkpoint']:.3f}")
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
