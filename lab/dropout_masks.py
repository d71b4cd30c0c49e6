"""Do drawn dropout masks keep the `quick` checkpoint's quality, and what do they save?

    python -m lab.dropout_masks --runs runs/dropout --data ag_news --seeds 7,13,21 --out dropout-masks.json

Trains `make run`'s checkpoint (MiniLM, AG News, `quick`, whole-model scope, `--no-sweep`) once per seed with
torch's dropout (``--set drawn_dropout=false``) and once with masks drawn by numpy's PCG64
(``drawn_dropout=true``, models/dropout.py), alternating, one training at a time; a run whose folder holds a
finished checkpoint is not trained again. Each checkpoint's hard accuracy is measured through the fp32 engine on
the first ``--limit`` test texts at ``--budgets``; each training's stage seconds come from its own record.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from headbudget.cli import OneLineParser
from headbudget.experiments.bench import code_commit, cpu_name
from lab.script_output import check_out, write_doc

KINDS = {"torch": "false", "drawn": "true"}


def train(folder: Path, data: str, seed: int, drawn: str) -> float:
    """Train one run unless it is finished; the seconds its stages took (from its config.json)."""
    if not (folder / "config.json").is_file():
        cmd = [sys.executable, "-m", "headbudget.cli", "train", "--base", "minilm", "--data", data, "--recipe",
               "quick", "--scope", "model", "--seed", str(seed), "--no-sweep", "--set", f"drawn_dropout={drawn}",
               "--out", str(folder)]
        subprocess.run(cmd, check=True)
    stages = json.loads((folder / "config.json").read_text())["stages"]
    return round(sum(s["seconds"] for s in stages.values()), 1)


def accuracy(folder: Path, data: str, budgets: list[float], limit: int) -> dict[str, float]:
    """Hard accuracy per budget through the fp32 engine (batches of 32 texts of similar length)."""
    from headbudget.engine.artifacts import checkpoint_config
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions
    from headbudget.experiments.report import checkpoint_split
    from headbudget.models.tokenizer import Encoded

    config, cfg = checkpoint_config(folder)
    _, _, split = checkpoint_split(folder, config, cfg.labels, cfg.max_position, data, "test", limit)
    engine = load_engine(folder, EngineOptions(precision="fp32"))
    order = np.argsort([len(x) for x in split.ids], kind="stable")
    out = {}
    for budget in budgets:
        right = 0
        for start in range(0, len(order), 32):
            idx = order[start:start + 32]
            ids, mask = Encoded([split.ids[i] for i in idx], [False] * len(idx)).padded()
            right += int((engine.predict_ids(ids, mask, budget).argmax(1) == split.labels[idx]).sum())
        out[f"{budget:g}"] = round(100 * right / len(order), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lab.dropout_masks", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, required=True, help="one folder per kind and seed (reused when finished)")
    p.add_argument("--data", default="ag_news")
    p.add_argument("--seeds", default="7,13,21")
    p.add_argument("--budgets", default="1,0.75,0.5,0.25,0.1")
    p.add_argument("--limit", type=int, default=2000, help="first N test texts")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        check_out(args.out)
        seeds = [int(s) for s in args.seeds.split(",")]
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError as e:
        p.error(str(e))
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        for kind, drawn in KINDS.items():
            folder = args.runs / f"{kind}-{seed}"
            t0 = time.time()
            seconds = train(folder, args.data, seed, drawn)
            acc = accuracy(folder, args.data, budgets, args.limit)
            rows.append({"kind": kind, "seed": seed, "train_stage_s": seconds, "accuracy": acc})
            print(json.dumps(rows[-1]), f"({time.time() - t0:.0f} s)", flush=True)
    mean = {kind: {b: round(statistics.mean(r["accuracy"][b] for r in rows if r["kind"] == kind), 2)
                   for b in rows[0]["accuracy"]} for kind in KINDS}
    doc = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(), "limit": args.limit,
           "rows": rows, "mean_accuracy": mean,
           "mean_train_stage_s": {k: round(statistics.mean(r["train_stage_s"] for r in rows if r["kind"] == k), 1)
                                  for k in KINDS}}
    write_doc(doc, args.out, "dropout_masks", argv)
    print(json.dumps({"mean_accuracy": mean, "mean_train_stage_s": doc["mean_train_stage_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
