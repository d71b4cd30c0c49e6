"""Where does a batch's CPU go when its texts differ in length? Engine CPU per text, one thread, one process.

The service batches what waits together (up to 32 texts at 32 connections); a pass pads every text to its
longest. This times, per budget and batch size, AG News test texts in file order (their real length mix) run
(1) one at a time, (2) each batch as one pass padded to its longest text, (3) each batch in passes by length
with a bound on the padding (``passes.split``) for several bounds. Modes alternate within each round, so drift
in the machine's speed hits them alike; each figure is the median over rounds of CPU per text (the thread's
own clock). ``padded_over_own`` is the tokens a mode runs over the texts' own tokens.

    python -m lab.batch_padding --model CKPT --data ../shared/data/ag_news --out batch-padding.json
"""

from __future__ import annotations

import csv
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser
from headbudget.engine import passes
from headbudget.engine.base import EngineBase, pad
from headbudget.engine.factory import load_engine
from headbudget.engine.names import PRECISION_NAMES
from headbudget.engine.types import EngineOptions
from headbudget.experiments.bench import code_commit, cpu_name
from lab.script_output import check_out, write_doc

PROG = "python -m lab.batch_padding"


def modes(pad_shares: list[float]) -> dict[str, float | None | str]:
    """Mode name -> the ``pad_share`` its passes use ("one" / "padded" for the two references)."""
    out: dict[str, float | None | str] = {"one_at_a_time": "one", "padded_to_longest": "padded"}
    out.update({f"by_length_{s:g}": s for s in pad_shares})
    return out


def groups_of(lengths: list[int], mode: float | None | str) -> list[list[int]]:
    if mode == "one":
        return [[i] for i in range(len(lengths))]
    if mode == "padded":
        return [list(range(len(lengths)))]
    assert not isinstance(mode, str)
    return passes.split(lengths, lambda b, n: True, mode)


def run_batches(engine: EngineBase, rows: list[list[int]], size: int, budget: float,
                mode: float | None | str) -> tuple[float, int]:
    """(CPU seconds, tokens run) for ``rows`` in batches of ``size``, each batch in ``mode``'s passes."""
    plan = engine.plan(budget)
    tokens = 0
    started = time.thread_time()
    for at in range(0, len(rows), size):
        batch = rows[at:at + size]
        lengths = [len(r) for r in batch]
        groups = groups_of(lengths, mode)
        tokens += passes.padded_tokens(lengths, groups)
        for g in groups:
            engine.forward_ids(*pad([batch[i] for i in g], engine.encoder.pad_id), plan)
    return time.thread_time() - started, tokens


def measure(model: Path, texts: list[str], budgets: list[float], sizes: list[int], pad_shares: list[float],
            rounds: int, precision: str, log: Callable[[str], None]) -> list[dict[str, Any]]:
    engine = load_engine(model, EngineOptions(precision=precision))
    assert isinstance(engine, EngineBase)
    engine.warmup()
    rows = [list(ids) for ids in engine.encoder.encode(texts).ids]
    own = sum(len(r) for r in rows)
    named = modes(pad_shares)
    out = []
    for budget in budgets:
        for size in sizes:
            names = [n for n in named if size > 1 or n == "one_at_a_time"]
            cpu: dict[str, list[float]] = {n: [] for n in names}
            ran: dict[str, int] = {}
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    seconds, ran[name] = run_batches(engine, rows, size, budget, named[name])
                    cpu[name].append(seconds * 1e3 / len(rows))
            for name in names:
                row = {"budget": budget, "batch": size, "mode": name,
                       "cpu_ms_per_text": round(statistics.median(cpu[name]), 3),
                       "padded_over_own": round(ran[name] / own, 3)}
                out.append(row)
                log(" ".join(f"{k}={v}" for k, v in row.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True, help="a folder with test.csv (text, label)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--pad-shares", type=float, nargs="+", default=[0.0, 0.125, 0.25, 0.5])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="int8", choices=PRECISION_NAMES)
    args = ap.parse_args(argv)
    try:
        check_out(args.out)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if not (args.data / "test.csv").is_file():
        print(f"{PROG}: error: no test.csv in {args.data}", file=sys.stderr)
        return 2
    with open(args.data / "test.csv", encoding="utf-8", newline="") as f:
        texts = [r["text"] for r in csv.DictReader(f) if r["text"].strip()][:args.texts]
    rows = measure(args.model, texts, args.budgets, args.sizes, args.pad_shares, args.rounds, args.precision,
                   lambda line: print(line, flush=True))
    write_doc({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(),
               "precision": args.precision, "ort_threads": 1, "texts": len(texts), "rounds": args.rounds,
               "rows": rows}, args.out, "batch_padding", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
