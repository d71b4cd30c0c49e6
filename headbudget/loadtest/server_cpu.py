"""Server CPU per answered request, by budget: `python -m headbudget.loadtest.server_cpu --model DIR --out FILE`.

Two runs, each against a real `headbudget serve` on 127.0.0.1 started and stopped here:
1. sequential: one worker, batch-1 AG News test texts one after another on one keep-alive connection;
2. load: two workers (``--load-workers``) under a few closed-loop clients (``--users``).
Each run goes in rounds; a round sends every budget in turn (``--requests`` texts or ``--seconds`` each), the
order rotated round by round so that drift in the machine's speed hits every budget alike. CPU comes from the
server's own counters around each step (``service_bench.server_cpu_s``): its processes' CPU time and its forward
passes' (``headbudget_engine_cpu_seconds_total``); what is left is what serving costs around the engine. Per
budget, each part is the median over rounds, and the total is their sum. ``loop_thread_ms_per_request`` is the
CPU of the threads that run the event loops (the processes' main threads), read from their own clocks: HTTP,
admission and answers, and the tokenizing of priced requests, which the engine's counter holds.

The tiers meter compute, as every shipped config does (``--unmetered``: request rate only), and every budget is
a tier's default. The file's top level holds the sequential run's figures (``workers``, ``cpu_ms_per_request``,
``engine_ms_per_request``, ``non_engine_ms_per_request``, ``loop_thread_ms_per_request``: maps from budget to
milliseconds); ``runs`` holds both runs with their rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES
from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest.capacity import mixed_config
from headbudget.loadtest.service_bench import (
    Server,
    bench_texts,
    closed_loop,
    cpu_per_request,
    loop_cpu_s,
    post_classify,
    server_cpu_s,
)
from headbudget.training.data import data_roots

PROG = "python -m headbudget.loadtest.server_cpu"
# A compute quota and per-request cap far above the load: requests are priced and billed, never refused.
METERED = "compute_per_minute = 100000000\nmax_request_compute = 1000000\n"


def config_text(budgets: list[float], metered: bool) -> str:
    """One tier per budget (the first one anonymous), metered unless ``metered`` is false."""
    text = mixed_config(budgets)
    return text.replace("max_queue = 4096\n", "max_queue = 4096\n" + METERED) if metered else text


def order(budgets: list[float], i: int) -> list[float]:
    """Round ``i``'s order of the budgets: rotated by one each round."""
    k = i % len(budgets)
    return budgets[k:] + budgets[:k]


def step(srv: Server, send: Any) -> dict[str, Any]:
    """CPU of the server over one step; ``send()`` runs the step and returns (answered, codes)."""
    before = server_cpu_s(srv, start=True)
    loop_before = loop_cpu_s(srv)
    answered, codes = send()
    loop_after = loop_cpu_s(srv)
    cpu = cpu_per_request(before, server_cpu_s(srv), max(1, answered))
    loop = (loop_after - loop_before) * 1e3 / max(1, answered) if loop_before is not None and loop_after is not None \
        else None
    return {"answered": answered, "codes": codes, "cpu_ms_per_request": cpu["cpu_ms_per_request"],
            "engine_ms_per_request": cpu["engine_cpu_ms_per_request"],
            "non_engine_ms_per_request": cpu["other_cpu_ms_per_request"], "loop_thread_ms_per_request": loop}


def rounds_of(srv: Server, budgets: list[float], rounds: int, send: Any) -> list[dict[str, Any]]:
    """``rounds`` rounds, each a step per budget in that round's order; ``send(budget)`` runs one step."""
    out = []
    for i in range(rounds):
        ordered = order(budgets, i)
        out.append({"order": [str(b) for b in ordered],
                    "steps": {str(b): step(srv, lambda b=b: send(b)) for b in ordered}})
    return out


def sequential(srv: Server, texts: list[str], budgets: list[float], rounds: int) -> list[dict[str, Any]]:
    """Rounds of batch-1 requests one after another, ``texts`` at each budget."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)

    def send(budget: float) -> tuple[int, dict[str, int]]:
        for t in texts:
            post_classify(conn, t, budget)  # raises on anything but 200
        return len(texts), {"200": len(texts)}

    try:
        for b in budgets:  # warm the connection, the sessions and the server's caches
            for t in texts[:10]:
                post_classify(conn, t, b)
        return rounds_of(srv, budgets, rounds, send)
    finally:
        conn.close()


def loaded(srv: Server, texts: list[str], budgets: list[float], rounds: int, users: int,
           seconds: float) -> list[dict[str, Any]]:
    """Rounds of ``users`` closed-loop clients for ``seconds`` at each budget."""

    def send(budget: float) -> tuple[int, dict[str, int]]:
        r = asyncio.run(closed_loop(srv.url, texts, budget, users, seconds))
        return int(r["codes"].get("200", 0)), r["codes"]

    asyncio.run(closed_loop(srv.url, texts[:50], budgets, users, min(2.0, seconds)))  # warm-up, every budget
    return rounds_of(srv, budgets, rounds, send)


def summary(budgets: list[float], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per budget, the median over rounds of the engine's and the rest's CPU per request; the total is their sum
    (each part robust to one noisy round, and total = engine + non-engine exactly)."""
    keys = [str(b) for b in budgets]
    engine = {b: statistics.median(r["steps"][b]["engine_ms_per_request"] for r in rounds) for b in keys}
    other = {b: statistics.median(r["steps"][b]["non_engine_ms_per_request"] for r in rounds) for b in keys}
    total = {b: engine[b] + other[b] for b in keys}
    loops = {b: [r["steps"][b]["loop_thread_ms_per_request"] for r in rounds] for b in keys}
    loop = {b: statistics.median(v) if None not in v else None for b, v in loops.items()}
    ratio = total["0.25"] / total["1.0"] if "0.25" in total and "1.0" in total and total["1.0"] > 0 else None
    return {"cpu_ms_per_request": total, "engine_ms_per_request": engine, "non_engine_ms_per_request": other,
            "loop_thread_ms_per_request": loop, "b025_over_b1": ratio,
            "n_requests": sum(s["answered"] for r in rounds for s in r["steps"].values()),
            "non_200": sum(n for r in rounds for s in r["steps"].values() for c, n in s["codes"].items() if c != "200")}


def measure(model: Path, texts: list[str], budgets: list[float], precision: str, rounds: int, metered: bool,
            load_workers: int, users: int, seconds: float) -> list[dict[str, Any]]:
    """The sequential run (one worker) and the run under load (``load_workers`` workers)."""
    cfg = config_text(budgets, metered)
    runs = []
    with Server(model, 1, config_text=cfg, precision=precision) as srv:
        seq = sequential(srv, texts, budgets, rounds)
    runs.append({"workers": 1, "clients": 1, "mode": "sequential", "texts_per_step": len(texts),
                 **summary(budgets, seq), "rounds": seq})
    if load_workers > 0:
        with Server(model, load_workers, config_text=cfg, precision=precision) as srv:
            load = loaded(srv, texts, budgets, rounds, users, seconds)
        runs.append({"workers": load_workers, "clients": users, "mode": "closed_loop", "seconds_per_step": seconds,
                     **summary(budgets, load), "rounds": load})
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    p.add_argument("--data", type=Path, default=None,
                   help="folder with test.csv (default: ag_news under $HEADBUDGET_DATA or ../shared/data)")
    p.add_argument("--precision", choices=PRECISION_NAMES, default="int8")
    p.add_argument("--budgets", default="1.0,0.5,0.25")
    p.add_argument("--requests", type=int, default=100, help="texts per budget and round, sequential run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--load-workers", type=int, default=2, help="workers of the run under load (0: skip it)")
    p.add_argument("--users", type=int, default=3, help="closed-loop clients of the run under load")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per budget and round, run under load")
    p.add_argument("--unmetered", action="store_true", help="tiers with a request rate only, no compute quota")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def error(msg: str) -> int:
        print(f"server_cpu: error: {msg}", file=sys.stderr)
        return 2

    try:
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        budgets = []
    if not budgets or not all(0.1 <= b <= 1.0 for b in budgets) or len(set(budgets)) != len(budgets):
        return error("--budgets takes distinct comma-separated budgets in [0.1, 1]")
    if args.requests < 1 or args.rounds < 1 or args.users < 1 or args.load_workers < 0 or not args.seconds > 0:
        return error("--requests, --rounds and --users at least 1, --load-workers at least 0, --seconds above 0")
    data = args.data or next((r / "ag_news" for r in data_roots() if (r / "ag_news" / "test.csv").is_file()),
                             Path("ag_news"))
    texts = bench_texts("server_cpu", args.model, data, args.requests)
    if texts is None:
        return 2
    runs = measure(args.model, texts, budgets, args.precision, args.rounds, not args.unmetered, args.load_workers,
                   args.users, args.seconds)
    headline = {k: runs[0][k] for k in ("workers", "cpu_ms_per_request", "engine_ms_per_request",
                                           "non_engine_ms_per_request", "loop_thread_ms_per_request", "b025_over_b1")}
    doc = {"precision": args.precision, "model": str(args.model), "metered": not args.unmetered,
           "budgets": [str(b) for b in budgets], **headline, "runs": runs,
           "n_requests": sum(r["n_requests"] for r in runs), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
           "commit": code_commit(short=False),
           "command": " ".join([PROG, *(sys.argv[1:] if argv is None else argv)])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps([{k: v for k, v in r.items() if k != "rounds"} for r in runs], indent=2))
    return 0 if all(r["non_200"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
