"""Requests per second and server CPU per answer as concurrency grows: `python -m headbudget.loadtest.concurrency`.

Against servers already running (a URL and the PID whose process tree is the server): headbudget at each budget
and, optionally, a dense peer (Infinity's ``/classify``). At each concurrency C, C keep-alive connections send AG
News test texts in file order, one text per request, each its next request as soon as its answer comes (a closed
loop), for ``--seconds`` after a short warm-up. Server CPU is read from the server's process tree (its processes'
CPU clocks); the engine's share from headbudget's ``headbudget_engine_cpu_seconds_total``. Steps are rotated run
by run, so drift in the machine's speed hits every server, budget and concurrency alike. Pin the server and this
client to different cores (``taskset``) to measure per core. ``--client wire`` sends over plain sockets
(``loadtest.wire``) instead of httpx, whose own milliseconds a request leave a server idle between requests.

    taskset -c 0 python -m headbudget.loadtest.concurrency --url http://127.0.0.1:8000 --pid PID \\
        --data ../shared/data/ag_news --out docs/results/CKPT/serving-concurrency.json
"""

from __future__ import annotations

import asyncio
import csv
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

from headbudget.commands.common import budget_arg
from headbudget.commands.parser import OneLineParser
from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest import wire
from headbudget.loadtest.service_bench import pct, tree_cpu_s

PROG = "python -m headbudget.loadtest.concurrency"
WARMUP_S = 2.0


@dataclass(frozen=True)
class Target:
    """One server under test, at one budget (None: a peer, which has none)."""

    server: str  # "headbudget" or "peer"
    url: str
    pid: int
    budget: float | None
    body: Callable[[str], dict[str, Any]]
    headers: dict[str, str]

    @property
    def engine_counter(self) -> bool:
        return self.server.startswith("headbudget")  # its before-and-after servers too


def headbudget_target(url: str, pid: int, budget: float, key: str | None) -> Target:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return Target("headbudget", url.rstrip("/") + "/classify", pid, budget,
                  lambda text: {"text": text, "budget": budget}, headers)


def peer_target(url: str, pid: int, model: str) -> Target:
    return Target("peer", url.rstrip("/") + "/classify", pid, None, lambda text: {"input": [text], "model": model},
                  {})


def engine_cpu_s(target: Target) -> float | None:
    if not target.engine_counter:
        return None
    text = httpx.get(target.url.rsplit("/", 1)[0] + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("headbudget_engine_cpu_seconds_total{"))


async def closed_loop(target: Target, texts: list[str], conc: int, seconds: float) -> tuple[int, list[float], int]:
    """(answers, their latencies in ms, other responses) of ``conc`` connections over ``seconds``."""
    latencies: list[float] = []
    failed = 0
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

    async def user(i: int) -> None:
        nonlocal failed
        async with httpx.AsyncClient(timeout=60, limits=limits, headers=target.headers) as client:
            j = i
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                r = await client.post(target.url, json=target.body(texts[j % len(texts)]))
                if r.status_code == 200:
                    latencies.append((time.perf_counter() - t0) * 1e3)
                else:
                    failed += 1
                j += conc

    await asyncio.gather(*(user(i) for i in range(conc)))
    return len(latencies), latencies, failed


def wire_loop(target: Target, texts: list[str], conc: int, seconds: float) -> tuple[int, list[float], int]:
    """``closed_loop`` over plain sockets, a thread a connection."""
    url = urlsplit(target.url)
    latencies: list[float] = []
    failed = [0]
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def user(i: int) -> None:
        with wire.Connection(url.port or 80, url.hostname or "127.0.0.1") as conn:
            j = i
            while time.monotonic() < stop:
                request = wire.post(url.path, target.headers, json.dumps(target.body(texts[j % len(texts)])).encode())
                t0 = time.perf_counter()
                status, _ = conn.send(request)
                with lock:
                    if status == 200:
                        latencies.append((time.perf_counter() - t0) * 1e3)
                    else:
                        failed[0] += 1
                j += conc

    wire.in_threads(user, conc)
    return len(latencies), latencies, failed[0]


def httpx_loop(target: Target, texts: list[str], conc: int, seconds: float) -> tuple[int, list[float], int]:
    return asyncio.run(closed_loop(target, texts, conc, seconds))


Loop = Callable[[Target, list[str], int, float], tuple[int, list[float], int]]
CLIENTS: dict[str, Loop] = {"httpx": httpx_loop, "wire": wire_loop}  # --client: the load generator's closed loop


def step(target: Target, texts: list[str], conc: int, seconds: float, run: int,
         loop: Loop = httpx_loop) -> dict[str, Any]:
    """One measured level: warm-up, then the CPU counters around ``seconds`` of the closed loop."""
    loop(target, texts, conc, WARMUP_S)
    engine0 = engine_cpu_s(target)  # the scrape goes outside the window
    cpu0, t0 = tree_cpu_s(target.pid), time.monotonic()
    answered, latencies, failed = loop(target, texts, conc, seconds)
    wall, cpu1 = time.monotonic() - t0, tree_cpu_s(target.pid)
    engine1 = engine_cpu_s(target)
    n = max(1, answered)
    engine = None if engine0 is None or engine1 is None else round((engine1 - engine0) * 1e3 / n, 3)
    return {"server": target.server, "budget": target.budget, "conc": conc, "run": run,
            "rps": round(answered / wall, 2), "p50_ms": round(pct(latencies, 0.5), 2) if latencies else None,
            "p99_ms": round(pct(latencies, 0.99), 2) if latencies else None,
            "cpu_ms_per_answer": round((cpu1 - cpu0) * 1e3 / n, 3), "engine_cpu_ms_per_answer": engine,
            "non_200": failed}


def plan(targets: list[Target], concs: list[int], runs: int) -> list[tuple[Target, int, int]]:
    """Every (target, concurrency) once per run, each run's order rotated by one step."""
    steps = [(t, c) for t in targets for c in concs]
    out = []
    for run in range(1, runs + 1):
        k = (run - 1) % len(steps)
        out += [(t, c, run) for t, c in steps[k:] + steps[:k]]
    return out


def load_texts(data: Path, n: int) -> list[str]:
    with open(data / "test.csv", encoding="utf-8", newline="") as f:
        return [r["text"] for r in csv.DictReader(f) if r["text"].strip()][:n]


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="headbudget's base URL")
    p.add_argument("--pid", type=int, required=True, help="headbudget's process (its tree is measured)")
    p.add_argument("--key", help="an API key for headbudget (none: the anonymous tier)")
    p.add_argument("--budgets", type=budget_arg, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--conc", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--client", choices=list(CLIENTS), default="httpx",
                   help="httpx (default), or prepared requests over plain sockets")
    p.add_argument("--data", type=Path, required=True, help="a folder with test.csv")
    p.add_argument("--texts", type=int, default=2000, help="the first N test texts, in file order")
    p.add_argument("--peer-url")
    p.add_argument("--peer-pid", type=int)
    p.add_argument("--peer-model", default=".", help="the model id the peer serves")
    p.add_argument("--peer-name", default="infinity-emb")
    p.add_argument("--peer-version")
    p.add_argument("--peer-precision", default="int8")
    p.add_argument("--peer-ort-threads", type=int, default=1)
    p.add_argument("--checkpoint", help="the checkpoint headbudget serves, as recorded in the file")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = None
    if not (args.data / "test.csv").is_file():
        problem = f"no test.csv in {args.data}"
    elif (args.peer_url is None) != (args.peer_pid is None):
        problem = "--peer-url and --peer-pid go together"
    elif not args.out.parent.is_dir():
        problem = f"--out: folder {args.out.parent} does not exist"
    elif min(args.conc) < 1 or args.runs < 1 or args.seconds <= 0:
        problem = "--conc, --runs and --seconds must be positive"
    else:
        for pid in filter(None, [args.pid, args.peer_pid]):
            if not psutil.pid_exists(pid):
                problem = f"no process {pid}"
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    texts = load_texts(args.data, args.texts)
    targets = [headbudget_target(args.url, args.pid, b, args.key) for b in args.budgets]
    if args.peer_url:
        targets.append(peer_target(args.peer_url, args.peer_pid, args.peer_model))
    rows = []
    try:
        for target, conc, run in plan(targets, args.conc, args.runs):
            rows.append(step(target, texts, conc, args.seconds, run, CLIENTS[args.client]))
            print(json.dumps(rows[-1]), flush=True)
    except (httpx.HTTPError, OSError, psutil.NoSuchProcess) as e:
        print(f"{PROG}: error: a server stopped answering ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    doc: dict[str, Any] = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(),
                           "checkpoint": args.checkpoint, "workers": 1, "seconds": args.seconds, "client": args.client,
                           "texts": len(texts), "rows": rows, "command": f"{PROG} " + " ".join(
                               sys.argv[1:] if argv is None else argv)}
    if args.peer_url:
        doc["peer"] = {"name": args.peer_name, "version": args.peer_version, "precision": args.peer_precision,
                       "ort_threads": args.peer_ort_threads}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
