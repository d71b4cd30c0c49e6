"""budget=auto through the service at batch 1, against fixed budgets of the same mean cost.

`python -m headbudget.loadtest.auto_latency --model DIR --out FILE`: the checkpoint needs a decider.json.
1. In this process, the engine gives auto's mean cost on the texts (each answer's whole-forward share, the
   cascade's cheap pass included) and the two grid budgets whose mean costs bracket it.
2. One server (one worker, those two budgets prepacked as tier defaults, like the decider's own stages) gets
   every text as `budget=auto` and at both fixed budgets, one request at a time, the three in random order per
   text, over several rounds; round trips are timed by the client.
The fixed budgets' mean latency is interpolated in mean cost to auto's: "a fixed budget of the same mean cost".
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES
from headbudget.loadtest.service_bench import CONFIG, Server, bench_texts, pct, post_classify
from headbudget.models.budget import BUDGET_GRID

# service_bench's one-tier server, plus a second tier: both fixed budgets are tier defaults, so both are prepacked.
OTHER_TIER = """
[tiers.other]
default_budget = {hi}
max_budget = 1.0
rate_limit = 1000000000
burst = 1000000
priority = 0
max_queue = 4096
"""


def _timed(conn: http.client.HTTPConnection, text: str, budget: float | str) -> tuple[float, dict[str, Any]]:
    """(round trip in ms, the text's result) of one batch-1 request."""
    t0 = time.perf_counter()
    answer = post_classify(conn, text, budget)
    return (time.perf_counter() - t0) * 1e3, answer["results"][0]


def mean_costs(model: Path, texts: list[str], precision: str) -> tuple[float, dict[float, float]]:
    """auto's mean cost and every grid budget's, from the engine in this process (same options as served)."""
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import Auto, EngineOptions

    engine = load_engine(model, EngineOptions(precision=precision, threads=1))
    if engine.info.decider is None:
        raise SystemExit(f"auto_latency: error: {model} has no usable decider.json (run `headbudget decider`)")
    auto = statistics.fmean(p.cost.ratio for t in texts for p in engine.run([t], Auto()).predictions)
    fixed = {b: statistics.fmean(p.cost.ratio for t in texts for p in engine.predict([t], b).predictions)
             for b in BUDGET_GRID}
    return auto, fixed


def bracket(target: float, fixed: dict[float, float]) -> tuple[float, float]:
    """The adjacent grid budgets whose mean costs enclose ``target`` (the nearest pair at either end)."""
    budgets = sorted(fixed)
    for lo, hi in zip(budgets, budgets[1:], strict=False):
        if fixed[lo] <= target <= fixed[hi]:
            return lo, hi
    return (budgets[0], budgets[1]) if target < fixed[budgets[0]] else (budgets[-2], budgets[-1])


def summary(ms: list[float]) -> dict[str, float]:
    return {"mean_ms": statistics.fmean(ms), "p50_ms": statistics.median(ms), "p90_ms": pct(ms, 0.9)}


def measure(model: Path, texts: list[str], rounds: int, precision: str) -> dict[str, Any]:
    auto_cost, fixed = mean_costs(model, texts, precision)
    lo, hi = bracket(auto_cost, fixed)
    times: dict[str, list[float]] = {"auto": [], str(lo): [], str(hi): []}
    passes: list[int] = []
    config = CONFIG.format(batch=32, wait=3.0, budget=lo) + OTHER_TIER.format(hi=hi)
    with Server(model, 1, precision=precision, config_text=config) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        for t in texts[:30]:  # warm-up: sessions, caches, the connection
            for b in ("auto", lo, hi):
                _timed(conn, t, b)
        rng = random.Random(0)
        for _ in range(rounds):
            for t in texts:
                order: list[float | str] = ["auto", lo, hi]
                rng.shuffle(order)
                for b in order:
                    ms, answer = _timed(conn, t, b)
                    times[str(b)].append(ms)
                    if b == "auto":
                        passes.append(len(answer.get("passes") or [answer["budget_applied"]]))
        conn.close()
    lo_ms, hi_ms = statistics.fmean(times[str(lo)]), statistics.fmean(times[str(hi)])
    w = 0.0 if fixed[hi] == fixed[lo] else (auto_cost - fixed[lo]) / (fixed[hi] - fixed[lo])
    at_cost = lo_ms + w * (hi_ms - lo_ms)
    auto = {**summary(times["auto"]), "mean_cost": auto_cost, "mean_passes": statistics.fmean(passes)}
    return {
        "auto": auto,
        "fixed": [{"budget": b, "mean_cost": fixed[b], **summary(times[str(b)])} for b in (lo, hi)],
        "fixed_mean_ms_at_auto_cost": at_cost,
        "auto_over_fixed": auto["mean_ms"] / at_cost,
    }


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m headbudget.loadtest.auto_latency", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, default=Path("../shared/data/ag_news"))
    p.add_argument("--requests", type=int, default=200, help="test texts (each sent once per round and budget)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", choices=PRECISION_NAMES, default="fp32")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    texts = bench_texts("auto_latency", args.model, args.data, args.requests)
    if texts is None:
        return 2
    from headbudget.experiments.bench import cpu_name

    result: dict[str, Any] = {"model": str(args.model), "data": str(args.data), "cpu": cpu_name(),
                              "date": time.strftime("%Y-%m-%d"), "precision": args.precision, "workers": 1,
                              "batch": 1, "n_texts": len(texts), "rounds": args.rounds,
                              "command": "python -m headbudget.loadtest.auto_latency " + " ".join(sys.argv[1:])}
    result.update(measure(args.model, texts, args.rounds, args.precision))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
