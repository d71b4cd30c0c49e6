"""Capacity and soak benchmark: `python -m headbudget.loadtest.capacity --model DIR --out load.json`.

For 2 workers (configurable), on 127.0.0.1 only:
1. capacity: for each budget, closed-loop clients at rising concurrency; the sustained requests per second
   of the highest level whose p99 stays under the target (250 ms), and the first level past it;
2. overload: far more clients than the queue holds: counts of 200 / 503 (with Retry-After) / other, and
   whether the server still answers /healthz afterwards;
3. soak: steady load for N seconds, sampling each worker's resident memory; growth from the first sample
   after warm-up to the last;
4. rate limit across workers (needs `redis-server`): one key, limit R/min with burst B, hammered through both
   workers; 200s counted against the exact allowance burst + rate * elapsed.
`--mixed` runs only this instead: the workers' forward-pass CPU per request with the budgets alternating request
by request, against each budget alone on the same server (what tiers sharing workers cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES
from headbudget.experiments.bench import cpu_name
from headbudget.loadtest.service_bench import (
    CONFIG,
    Server,
    bench_texts,
    closed_loop,
    cpu_per_request,
    free_port,
    server_cpu_s,
)

SOAK_CONFIG = CONFIG.replace("queue_size = 4096", "queue_size = {queue}").replace("max_queue = 4096",
                                                                                  "max_queue = {queue}")


def capacity(model: Path, texts: list[str], workers: int, budgets: list[float], target_ms: float,
             seconds: float, levels: list[int], precision: str = "fp32") -> list[dict[str, Any]]:
    """Highest sustained rps with p99 under ``target_ms`` per budget."""
    out = []
    for b in budgets:
        with Server(model, workers, 32, 3.0, b, precision=precision) as srv:
            dtype = httpx.get(f"{srv.url}/info", timeout=10).json().get("model_dtype")  # what the server runs
            asyncio.run(closed_loop(srv.url, texts[:50], b, 4, 2.0))
            runs = []
            for users in levels:
                before = server_cpu_s(srv, start=True)
                r = asyncio.run(closed_loop(srv.url, texts, b, users, seconds))
                if r["codes"].get("200"):
                    r.update(cpu_per_request(before, server_cpu_s(srv), r["codes"]["200"]))
                runs.append(r)
                if r["p99_ms"] is None or r["p99_ms"] > target_ms:
                    break
        good = [r for r in runs if r["p99_ms"] is not None and r["p99_ms"] <= target_ms]
        best = max(good, key=lambda r: r["rps"]) if good else None
        out.append({"budget": b, "served_dtype": dtype, "sustained_rps": best["rps"] if best else 0.0,
                    "at_users": best["users"] if best else None, "p99_ms": best["p99_ms"] if best else None,
                    **{k: best.get(k) if best else None for k in ("cpu_ms_per_request", "engine_cpu_ms_per_request",
                                                                  "other_cpu_ms_per_request")},
                    "levels": runs})
    return out


def mixed_config(budgets: list[float]) -> str:
    """The bench service with one tier per budget, each a copy of its bench tier, so that every budget of a mix
    is prepacked as a tier default is (the anonymous tier is the first); requests carry their own budget."""
    tier = CONFIG[CONFIG.index("[tiers.bench]"):]
    extra = "".join("\n" + tier.replace("[tiers.bench]", f"[tiers.b{i}]").format(budget=b)
                    for i, b in enumerate(budgets[1:], 1))
    return CONFIG.format(batch=32, wait=3.0, budget=budgets[0]) + extra


def mixed_traffic(model: Path, texts: list[str], workers: int, budgets: list[float], users: int, seconds: float,
                  rounds: int, precision: str = "fp32") -> dict[str, Any]:
    """Forward-pass CPU per request when budgets alternate request by request, against each budget alone.

    One server, every budget prepacked; each round runs every budget alone and the mix (odd rounds the mix
    first), ``seconds`` each, so drift between them is small and evens out. ``expected``: the mix's cost if
    budgets did not disturb each other, the single-budget figures of the same round weighted by how many
    answers each budget got in the mix.
    Why: a budget's weights stay in the CPU's caches only while its own calls follow each other
    (docs/results.md, 'Cache state and the small budgets'); this is what that costs a server whose tiers share
    workers.
    """
    out = []
    with Server(model, workers, config_text=mixed_config(budgets), precision=precision) as srv:
        asyncio.run(closed_loop(srv.url, texts[:50], budgets, users, 2.0))  # warm-up: every budget's sessions
        for i in range(rounds):
            # odd rounds run the mix first, so that drift within a round does not always favour one side
            steps: list[float | list[float]] = [*budgets, budgets] if i % 2 == 0 else [budgets, *budgets]
            single, forward_single = {}, {}
            for step in steps:
                before = server_cpu_s(srv, start=True)
                r = asyncio.run(closed_loop(srv.url, texts, step, users, seconds, forward=True))
                cpu = cpu_per_request(before, server_cpu_s(srv), r["codes"].get("200", 0) or 1)
                if isinstance(step, list):
                    mixed, n, forward_mixed = cpu, r["answered_by_budget"], r["forward_ms_p50_by_budget"]
                else:
                    single[str(step)] = cpu
                    forward_single.update(r["forward_ms_p50_by_budget"])
            expected = sum(n[b] * single[b]["engine_cpu_ms_per_request"] for b in n) / max(1, sum(n.values()))
            out.append({"order": [str(x) for x in steps], "single": single, "mixed": mixed, "answered_by_budget": n,
                        "expected_engine_cpu_ms_per_request": expected,
                        "mixed_over_expected": mixed["engine_cpu_ms_per_request"] / expected if expected else None,
                        # the answers' own forward-pass medians: what the bench's speedup over b = 1 is in serving
                        "forward_ms_p50": {"single": forward_single, "mixed": forward_mixed},
                        "speedup_over_top": {k: _speedups(v, budgets) for k, v in
                                             (("single", forward_single), ("mixed", forward_mixed))}})
    ratios = sorted(r["mixed_over_expected"] for r in out if r["mixed_over_expected"] is not None)
    return {"budgets": budgets, "users": users, "seconds": seconds, "workers": workers, "precision": precision,
            "rounds": out, "median_mixed_over_expected": ratios[len(ratios) // 2] if ratios else None}


def _speedups(forward_ms: dict[str, float | None], budgets: list[float]) -> dict[str, float | None]:
    """Each budget's forward pass against the largest budget's, from the answers' medians."""
    top = forward_ms.get(str(max(budgets)))
    return {b: (top / ms if top and ms else None) for b, ms in forward_ms.items()}


def overload(model: Path, texts: list[str], workers: int, users: int, seconds: float) -> dict[str, Any]:
    """Many more clients than a small queue holds: the server sheds with 503 + Retry-After and stays up."""
    cfg = SOAK_CONFIG.format(batch=32, wait=3.0, budget=1.0, queue=16)
    with Server(model, workers, config_text=cfg) as srv:
        r = asyncio.run(closed_loop(srv.url, texts, 1.0, users, seconds))
        r["healthz_after"] = httpx.get(f"{srv.url}/healthz", timeout=5).status_code
        r["server_alive_after"] = srv.proc.poll() is None
    return r


def worker_rss_mb(root_pid: int) -> list[float]:
    """Resident memory of each process under the server (uvicorn workers and the supervisor's children)."""
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return sorted(round(p.memory_info().rss / 2**20, 1) for p in children if p.is_running())


def soak(model: Path, texts: list[str], workers: int, users: int, seconds: float, every: float,
         warmup_s: float = 0.0, feedback_max_entries: int | None = None) -> dict[str, Any]:
    """Steady load; each worker's RSS every ``every`` seconds, after ``warmup_s`` of unsampled load.

    The service keeps every answer for feedback, bounded by [state] feedback_max_entries: memory grows until
    that store is full. A warm-up long enough to fill it shows the steady state.
    """
    samples: list[dict[str, Any]] = []
    cfg = CONFIG.format(batch=32, wait=3.0, budget=0.5)
    if feedback_max_entries:
        cfg += f"\n[state]\nfeedback_max_entries = {feedback_max_entries}\n"
    with Server(model, workers, config_text=cfg) as srv:
        if warmup_s > 0:
            asyncio.run(closed_loop(srv.url, texts, 0.5, users, warmup_s))

        async def run() -> dict[str, Any]:
            async def sample() -> None:
                t0 = time.monotonic()
                while time.monotonic() - t0 < seconds:
                    samples.append({"t": round(time.monotonic() - t0, 1), "rss_mb": worker_rss_mb(srv.proc.pid)})
                    await asyncio.sleep(every)
            res, _ = await asyncio.gather(closed_loop(srv.url, texts, 0.5, users, seconds), sample())
            return res
        load = asyncio.run(run())
    first = next((s for s in samples if s["t"] >= min(60.0, seconds / 5)), samples[0])
    last = samples[-1]
    growth = [(b - a) / a * 100 for a, b in zip(first["rss_mb"], last["rss_mb"], strict=False) if a]
    return {"seconds": seconds, "users": users, "warmup_s": warmup_s, "feedback_max_entries": feedback_max_entries,
            "load": load, "samples": samples,
            "rss_growth_percent_per_process": [round(g, 2) for g in growth],
            "flat_within_5_percent": all(abs(g) <= 5 for g in growth)}


def rate_limit_across_workers(model: Path, texts: list[str], workers: int, rate_per_min: float, burst: int,
                              seconds: float) -> dict[str, Any]:
    """One key through ``workers`` workers sharing Redis: allowed requests vs the exact allowance."""
    exe = shutil.which("redis-server")
    if not exe:
        return {"skipped": "redis-server not installed"}
    port = free_port()
    redis = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import hashlib

        key = "hb-capacity-test-key"
        cfg_text = (f'[server]\nmax_batch_size = 32\nmax_wait_ms = 3\n[state]\nredis_url = "redis://127.0.0.1:{port}/0"\n'
                    f'[tiers.t]\ndefault_budget = 0.25\nmax_budget = 1.0\nrate_limit = {rate_per_min}\nburst = {burst}\n'
                    f'max_queue = 4096\n[[keys]]\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\ntier = "t"\n')
        with Server(model, workers, config_text=cfg_text) as srv:
            codes: dict[str, int] = {}

            async def hammer() -> float:
                t0 = time.monotonic()
                async def user() -> None:
                    async with httpx.AsyncClient(base_url=srv.url, timeout=30, headers={"X-API-Key": key}) as c:
                        while time.monotonic() - t0 < seconds:
                            r = await c.post("/classify", json={"text": texts[0]})
                            codes[str(r.status_code)] = codes.get(str(r.status_code), 0) + 1
                await asyncio.gather(*(user() for _ in range(8)))
                return time.monotonic() - t0
            elapsed = asyncio.run(hammer())
        allowed = codes.get("200", 0)
        allowance = burst + rate_per_min / 60.0 * elapsed
        return {"workers": workers, "rate_per_min": rate_per_min, "burst": burst, "elapsed_s": elapsed,
                "codes": codes, "allowed": allowed, "exact_allowance": allowance,
                "excess_over_allowance": allowed - allowance}
    finally:
        redis.terminate()
        redis.wait()


def _merge_into(out: Path, res: dict[str, Any]) -> None:
    """Write ``res`` over what ``out`` already holds (a step run on its own keeps the other steps' results)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.is_file() else {}
    out.write_text(json.dumps({**old, **res}, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m headbudget.loadtest.capacity", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, default=Path("../shared/data/ag_news"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--budgets", default="1.0,0.5,0.25")
    p.add_argument("--target-p99-ms", type=float, default=250.0)
    p.add_argument("--step-seconds", type=float, default=10.0)
    p.add_argument("--levels", default="1,2,4,8,16,32")
    p.add_argument("--soak-seconds", type=float, default=600.0)
    p.add_argument("--soak-users", type=int, default=4)
    p.add_argument("--soak-warmup-seconds", type=float, default=0.0)
    p.add_argument("--feedback-max-entries", type=int, default=None, help="service [state] setting for the soak")
    p.add_argument("--only-soak", action="store_true",
                   help="run only the soak and add it to an existing --out file as soak_<entries>")
    p.add_argument("--capacity-only", action="store_true",
                   help="run only the capacity sweep (with CPU per request) and merge it into an existing --out file")
    p.add_argument("--mixed", action="store_true",
                   help="only measure the forward passes' CPU per request with --budgets alternating request by "
                        "request against each alone (--mixed-users clients, --step-seconds each, --mixed-rounds)")
    p.add_argument("--mixed-users", type=int, default=2)
    p.add_argument("--mixed-rounds", type=int, default=3)
    p.add_argument("--precision", choices=PRECISION_NAMES, default="fp32",
                   help="the engine the capacity step serves (`headbudget serve` defaults to int8; fp32 is what the "
                        "recorded runs used)")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        budgets = [float(b) for b in a.budgets.split(",")]
    except ValueError:
        budgets = []
    if not budgets or not all(0.0 < b <= 1.0 for b in budgets) or a.mixed_users < 1 or a.mixed_rounds < 1:
        print("capacity: error: --budgets takes comma-separated budgets in (0, 1]; --mixed-users and "
              "--mixed-rounds at least 1", file=sys.stderr)
        return 2
    texts = bench_texts("capacity", a.model, a.data, 500)
    if texts is None:
        return 2
    if a.only_soak:
        r = soak(a.model, texts, a.workers, a.soak_users, a.soak_seconds, 10.0, a.soak_warmup_seconds,
                 a.feedback_max_entries)
        print(json.dumps({k: v for k, v in r.items() if k != "samples"}), flush=True)
        _merge_into(a.out, {f"soak_{a.feedback_max_entries or 'default'}": r})
        return 0
    res = {"model": str(a.model), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
           "workers": a.workers, "target_p99_ms": a.target_p99_ms, "precision": a.precision}
    if a.mixed:
        res["mixed"] = mixed_traffic(a.model, texts, a.workers, budgets, a.mixed_users, a.step_seconds,
                                     a.mixed_rounds, a.precision)
        print(json.dumps({k: v for k, v in res["mixed"].items() if k != "rounds"}), flush=True)
        _merge_into(a.out, res)
        return 0
    res["capacity"] = capacity(a.model, texts, a.workers, budgets,
                               a.target_p99_ms, a.step_seconds, [int(x) for x in a.levels.split(",")], a.precision)
    # What an operator pays for: the workers' CPU per answered request at the sustained level, by budget.
    res["cpu_per_request"] = [{"budget": c["budget"], "cpu_ms_per_request": c["cpu_ms_per_request"],
                               "engine_cpu_ms_per_request": c["engine_cpu_ms_per_request"],
                               "other_cpu_ms_per_request": c["other_cpu_ms_per_request"], "rps": c["sustained_rps"],
                               "p99_ms": c["p99_ms"], "at_users": c["at_users"]} for c in res["capacity"]]
    print(json.dumps(res["cpu_per_request"]), flush=True)
    if a.capacity_only:
        _merge_into(a.out, res)
        return 0
    res["rate_limit"] = rate_limit_across_workers(a.model, texts, a.workers, 600.0, 20, 15.0)
    print(json.dumps(res["rate_limit"]), flush=True)
    res["overload"] = overload(a.model, texts, a.workers, 96, 10.0)
    print(json.dumps(res["overload"]), flush=True)
    if a.soak_seconds > 0:
        res["soak"] = soak(a.model, texts, a.workers, a.soak_users, a.soak_seconds, 10.0, a.soak_warmup_seconds,
                           a.feedback_max_entries)
        print(json.dumps({k: v for k, v in res["soak"].items() if k != "samples"}), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
