"""A worker's memory under the largest requests the API admits: `python -m headbudget.loadtest.memory --model DIR
--out FILE`.

One worker. Its resident memory (VmRSS in /proc) idle after a few short requests; sampled every 5 ms while
requests of 64 texts at the model's longest length run at several budgets, one after another and then one per
key from several keys at once, for ``--rounds``; and after them. Also the batch-1 round trip of a short text
before and after, and, given a cap, how long the largest pass under it takes in this process (what a short
request may wait behind). ``--max-activation-mb`` sets [server] max_activation_mb; left out, the config names none (a server
from before the setting takes the config).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES
from headbudget.loadtest.service_bench import Server
from headbudget.service.accounting.auth import hash_key

TEXTS = 64  # the most texts a request may carry (service/http/schemas.py MAX_TEXTS)
KEYS = {f"tenant{i}": f"hb_memory_tenant{i}_key_000000000000000" for i in range(1, 4)}
SHORT = "A new chip promises faster machine learning on phones."


def config_text(max_activation_mb: int | None) -> str:
    """Three keys, each on its own tier, every budget allowed, limits out of the way."""
    cap = "" if max_activation_mb is None else f"max_activation_mb = {max_activation_mb}\n"
    lines = [f"[server]\nmax_batch_size = 32\nmax_wait_ms = 3\nqueue_size = 256\nrequest_timeout_s = 600\n{cap}"]
    for name in KEYS:
        lines.append(f"[tiers.{name}]\ndefault_budget = 1.0\nmax_budget = 1.0\nrate_limit = 100000\nburst = 1000\n"
                     "max_queue = 64\n")
    for name, key in KEYS.items():
        lines.append(f'[[keys]]\nsha256 = "{hash_key(key)}"\ntier = "{name}"\nname = "{name}"\n')
    return "\n".join(lines)


def rss_mb(pid: int) -> float:
    """The process's resident memory (VmRSS), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Sampler:
    """The highest resident memory of a process, sampled every 5 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = self._since = rss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = rss_mb(self.pid)
            self.peak, self._since = max(self.peak, now), max(self._since, now)
            time.sleep(0.005)

    def take(self) -> float:
        """The highest sample since the last ``take``."""
        peak, self._since = self._since, rss_mb(self.pid)
        return peak

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def short_ms(url: str, n: int = 30) -> float:
    """Median round trip of a one-text request on one keep-alive connection, ms."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"text": SHORT, "budget": 0.5})
    headers = {"Content-Type": "application/json", "X-API-Key": KEYS["tenant1"]}
    times = []
    try:
        for _ in range(n + 3):
            t0 = time.perf_counter()
            conn.request("POST", "/classify", body, headers)
            resp = conn.getresponse()
            resp.read()
            times.append((time.perf_counter() - t0) * 1000)
            if resp.status != 200:
                raise RuntimeError(f"short request answered {resp.status}")
    finally:
        conn.close()
    return round(statistics.median(times[3:]), 2)


async def _post_all(url: str, jobs: list[tuple[str, float]], texts: list[str],
                    length: int) -> list[tuple[int, float]]:
    """Each (key, budget) job as one request of ``texts``, all at once: (status, seconds) each."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(key: str, budget: float) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = await client.post("/classify", json={"texts": texts, "budget": budget},
                                  headers={"X-API-Key": KEYS[key]})
            if r.status_code == 200 and [x["n_tokens"] for x in r.json()["results"]] != [length] * len(texts):
                raise RuntimeError(f"expected {len(texts)} texts of {length} tokens in the answer")
            return r.status_code, round(time.perf_counter() - t0, 2)

        return list(await asyncio.gather(*(one(k, b) for k, b in jobs)))


def largest_pass_ms(model: Path, precision: str, max_activation_mb: int, length: int) -> dict[str, Any]:
    """The largest pass the cap allows at ``length`` tokens and budget 1, timed in this process (median of 3)."""
    from headbudget.engine import passes
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions

    engine = load_engine(model, EngineOptions(precision=precision))  # type: ignore[arg-type]
    plan = engine.plan(1.0)
    texts = TEXTS
    while texts > 1 and passes.activation_bytes(engine.shape, plan, texts, length) > max_activation_mb << 20:
        texts -= 1
    rows = [[101] + [2000] * (length - 2) + [102]] * texts
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.forward_rows(rows, plan)
        times.append((time.perf_counter() - t0) * 1000)
    engine.close()
    return {"texts": texts, "tokens": length, "budget": 1.0, "ms": round(statistics.median(times), 1)}


def measure(model: Path, precision: str = "int8", max_activation_mb: int | None = None,
            budgets: tuple[float, ...] = (0.25, 0.5, 1.0), rounds: int = 1, alone: bool = True) -> dict[str, Any]:
    """Start one worker, measure, stop it; the figures as a dict (MB, seconds, ms). ``alone=False``: only the
    requests from several keys at once, not each budget's request alone first."""
    with Server(model, 1, config_text=config_text(max_activation_mb), precision=precision) as srv:
        info = httpx.get(f"{srv.url}/v1/models", headers={"X-API-Key": KEYS["tenant1"]}, timeout=30).json()
        length = int(info["data"][0]["max_length"])
        texts = [" ".join(["word"] * (2 * length))] * TEXTS  # each cut to the longest length
        before = short_ms(srv.url)
        time.sleep(1.0)
        idle = rss_mb(srv.proc.pid)
        requests: list[dict[str, Any]] = []
        keys = list(KEYS)
        with Sampler(srv.proc.pid) as sampler:
            for r in range(rounds):
                for i, b in enumerate(budgets if alone else ()):
                    [(status, s)] = asyncio.run(_post_all(srv.url, [(keys[i % len(keys)], b)], texts, length))
                    requests.append({"round": r, "keys": 1, "budget": b, "status": [status], "seconds": s,
                                     "peak_mb": round(sampler.take()), "rss_mb": round(rss_mb(srv.proc.pid))})
                jobs = [(keys[i % len(keys)], b) for i, b in enumerate(budgets)]
                answers = asyncio.run(_post_all(srv.url, jobs, texts, length))
                requests.append({"round": r, "keys": len(jobs), "budget": list(budgets),
                                 "status": [a[0] for a in answers], "seconds": max(a[1] for a in answers),
                                 "peak_mb": round(sampler.take()), "rss_mb": round(rss_mb(srv.proc.pid))})
            time.sleep(2.0)
        after = rss_mb(srv.proc.pid)
        after_short = short_ms(srv.url)
    return {"idle_mb": round(idle), "peak_mb": round(sampler.peak), "after_mb": round(after),
            "peak_over_idle_mb": round(sampler.peak - idle), "after_over_idle_mb": round(after - idle),
            "max_length": length, "texts": TEXTS, "requests": requests,
            "short_ms_before": before, "short_ms_after": after_short}


def supervisor_mb(model: Path, precision: str) -> float:
    """With two workers: the resident memory of the processes beside them (the serving process that supervises
    them, and its helpers), which a pod holding several workers also pays for."""
    import psutil

    with Server(model, 2, config_text=config_text(None), precision=precision) as srv:
        time.sleep(1.0)
        root = psutil.Process(srv.proc.pid)
        children = root.children(recursive=True)
        others = [root, *(c for c in children if "spawn_main" not in " ".join(c.cmdline()))]  # not the workers
        assert len(children) - len(others) + 1 == 2, [c.cmdline() for c in children]
        return round(sum(p.memory_info().rss for p in others) / 2**20)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m headbudget.loadtest.memory", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--precision", choices=PRECISION_NAMES, default="int8")
    p.add_argument("--max-activation-mb", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from headbudget.experiments.bench import code_commit, cpu_name

    run = "python -m headbudget.loadtest.memory" if __spec__ is not None else "python headbudget/loadtest/memory.py"
    result: dict[str, Any] = {"command": " ".join([run, *(argv or sys.argv[1:])]),
                              "model": str(args.model), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
                              "commit": code_commit(), "precision": args.precision, "workers": 1,
                              "max_activation_mb": args.max_activation_mb}
    result.update(measure(args.model, args.precision, args.max_activation_mb, rounds=args.rounds))
    result["beside_workers_mb"] = supervisor_mb(args.model, args.precision)
    if args.max_activation_mb is not None:
        result["largest_pass"] = largest_pass_ms(args.model, args.precision, args.max_activation_mb,
                                                 result["max_length"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
