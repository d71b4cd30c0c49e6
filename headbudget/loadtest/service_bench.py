"""Server overhead and throughput benchmark: `python -m headbudget.loadtest.service_bench --model DIR --out FILE`.

1. Overhead: one worker, batch-1 requests one after another; for each text, round-trip time minus the
   engine's own latency for the same text and budget (one call in this process, same engine options, paired
   with the server in blocks of 20 texts).
2. Throughput: N workers under C concurrent clients for D seconds, with micro-batching (the configured batch
   window) and without it (max_batch_size = 1, no wait), counting 200 answers.
Everything runs on 127.0.0.1; every server started here is stopped here.
"""

from __future__ import annotations

import asyncio
import csv
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence, Set
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES

CONFIG = """
[server]
max_batch_size = {batch}
max_wait_ms = {wait}
queue_size = 4096
request_timeout_s = 30

[development]
anonymous_tier = "bench"

[tiers.bench]
default_budget = {budget}
max_budget = 1.0
rate_limit = 1000000000
burst = 1000000
priority = 0
max_queue = 4096
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_texts(folder: Path, n: int, seed: int = 0) -> list[str]:
    with open(folder / "test.csv", encoding="utf-8", newline="") as f:
        texts = [r["text"] for r in csv.DictReader(f) if r["text"].strip()]
    random.Random(seed).shuffle(texts)
    return texts[:n]


def bench_texts(prog: str, model: Path, data: Path, n: int) -> list[str] | None:
    """The benchmark's test texts, or None after one error line when the checkpoint or the data is missing."""
    if not (model / "config.json").is_file() or not (data / "test.csv").is_file():
        print(f"{prog}: error: need a checkpoint folder and a data folder with test.csv", file=sys.stderr)
        return None
    return load_texts(data, n)


class Server:
    """`headbudget serve` in a subprocess on a free loopback port, stopped on exit."""

    def __init__(self, model: Path, workers: int, batch: int = 32, wait_ms: float = 3.0, budget: float = 0.5,
                 config_text: str | None = None, precision: str = "fp32", cpus: str | None = None) -> None:
        self.port = free_port()
        self.dir = tempfile.TemporaryDirectory()
        cfg = Path(self.dir.name) / "bench.toml"
        cfg.write_text(config_text or CONFIG.format(batch=batch, wait=wait_ms, budget=budget))
        cmd = [sys.executable, "-m", "headbudget.cli", "serve", "--model", str(model), "--config", str(cfg),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers), "--precision", precision, "--log-level", "warning",
               # CPU per request depends on the plans, not the weights: a stand-in of a checkpoint measures it
               "--allow-standin"]
        if cpus:  # the server's whole process tree on these cores (taskset's list form: "1" or "0,1")
            cmd = ["taskset", "-c", cpus, *cmd]
        # The access log goes to a file: an unread pipe fills after ~64 KB and then blocks the server.
        self.log = open(Path(self.dir.name) / "server.log", "w+b")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        wait_ready(self.proc, self.log, f"{self.url}/readyz", 180, "server")
        return self

    def __exit__(self, *exc: object) -> None:
        stop_group(self.proc, 40)
        self.log.close()
        self.dir.cleanup()


def wait_ready(proc: subprocess.Popen[bytes], log: IO[bytes], url: str, timeout_s: float, what: str) -> None:
    """Until ``url`` answers 200; RuntimeError with the end of ``log`` if ``proc`` exits first, or after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{what} exited: {log.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready in {timeout_s:g} s")


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL if it is still there after ``timeout_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def pinned(cpus: Set[int] | None) -> Iterator[None]:
    """This process on ``cpus`` for the block, its affinity given back after (None: as it is)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def server_cpu_s(srv: Server, start: bool = False) -> tuple[float, float]:
    """(CPU seconds of the server's processes (supervisor and workers), CPU seconds of its forward passes) so
    far: the workers' own counters, which do not depend on the load generator sharing the cores.

    Reading the engine's counter is a /metrics scrape, which costs the server CPU of its own (milliseconds where
    several workers' files are merged). ``start``: the reading opens a window, so the scrape goes first; a closing
    reading scrapes last. Either way the scrape stays outside the window."""
    if start:
        engine = _engine_cpu_s(srv)
        return _process_cpu_s(srv), engine
    total = _process_cpu_s(srv)
    return total, _engine_cpu_s(srv)


def _process_cpu_s(srv: Server) -> float:
    return tree_cpu_s(srv.proc.pid)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds so far of process ``pid`` and its descendants (a server's supervisor and workers)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += _cpu_clock_s(proc.pid)
        except OSError:
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def _cpu_clock_s(pid: int) -> float:
    """A process's CPU time from its CPU-time clock (what clock_getcpuclockid names on Linux): nanoseconds, all
    its threads, where psutil's counters tick every 10 ms, which is 0.1 ms a request over 100 requests."""
    if not sys.platform.startswith("linux"):
        raise OSError("process CPU clocks by pid are Linux's")
    return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the whole process


def loop_cpu_s(srv: Server) -> float | None:
    """CPU seconds so far of the server's processes' main threads, where each worker runs its event loop (with
    several workers, the supervisor's main thread too, which is idle); the rest runs on other threads, the engine's
    above all. None where no thread's CPU time can be read (not Linux)."""
    import psutil

    root = psutil.Process(srv.proc.pid)
    total, read = 0.0, False
    for proc in [root, *root.children(recursive=True)]:
        # A main thread's id is its process's. Its CPU clock is readable from its own process only; schedstat's
        # first field is the same count (nanoseconds on a CPU), where the 10 ms ticks of stat would be too coarse.
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0]) / 1e9
            read = True
        except OSError:  # the process ended (or a kernel without schedstat)
            continue
    return total if read else None


def _engine_cpu_s(srv: Server) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("headbudget_engine_cpu_seconds_total{"))


def cpu_per_request(before: tuple[float, float], after: tuple[float, float], answered: int) -> dict[str, float]:
    """Server CPU per answered request, split into forward passes and everything else (ms)."""
    total, engine = (after[0] - before[0]) * 1e3 / answered, (after[1] - before[1]) * 1e3 / answered
    return {"cpu_ms_per_request": total, "engine_cpu_ms_per_request": engine,
            "other_cpu_ms_per_request": total - engine}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


BLOCK = 20  # texts per pairing block in the overhead benchmark


def _time_block(conn: http.client.HTTPConnection, block: list[str], budget: float, rtt: list[float],
                forward_ms: list[float], handler_ms: list[float]) -> None:
    """One request per text: its round trip, and the server's own clock around the forward pass and the handler."""
    for t in block:
        t0 = time.perf_counter()
        answer = post_classify(conn, t, budget)
        rtt.append((time.perf_counter() - t0) * 1e3)
        forward_ms.append(float(answer["results"][0]["latency_ms"]))
        handler_ms.append(float(answer["latency_ms"]))


def _healthz_ms(conn: http.client.HTTPConnection) -> float:
    t0 = time.perf_counter()
    conn.request("GET", "/healthz")
    conn.getresponse().read()
    return (time.perf_counter() - t0) * 1e3


def overhead(model: Path, texts: list[str], budget: float, wait_ms: float, precision: str = "fp32") -> dict[str, Any]:
    """Round trip minus the engine's own time, per text, one worker, sequential batch-1 requests."""
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions

    # The same engine options as the server's (serve defaults to int8 where it can: name it on both sides).
    engine = load_engine(model, EngineOptions(precision="int8" if precision == "int8" else "fp32"))
    engine.warmup()

    def engine_ms_for(text: str) -> float:
        t0 = time.perf_counter()
        engine.predict([text], budget)
        return (time.perf_counter() - t0) * 1e3

    engine_ms: list[float] = []
    rtt: list[float] = []
    forward_ms: list[float] = []
    handler_ms: list[float] = []
    with Server(model, 1, 32, wait_ms, budget, precision=precision) as srv:
        # A bare keep-alive http.client connection: the figure is the server's overhead, and httpx's own
        # per-request cost would be counted in it otherwise.
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        try:
            for t in texts[:20]:  # warm the connection and the server's caches
                post_classify(conn, t, budget)
            # Paired in time, block by block: this process's engine on a block of texts, then the server on
            # the same block, so drift in the machine's speed (a shared VM here) hits both sides alike. One
            # engine call per text, as the server makes one; blocks, not text by text, because two copies of
            # the model taking turns evict each other's weights from the shared cache, which slows the server's
            # forward pass below its steady state.
            cpu_before = server_cpu_s(srv, start=True)
            for start in range(0, len(texts), BLOCK):
                block = texts[start:start + BLOCK]
                engine_ms += [engine_ms_for(t) for t in block]
                _time_block(conn, block, budget, rtt, forward_ms, handler_ms)
            cpu = cpu_per_request(cpu_before, server_cpu_s(srv), len(texts))
            floor = [_healthz_ms(conn) for _ in texts]  # the floor: the same connection, a route that does nothing
        finally:
            conn.close()
            engine.close()
    diffs = [a - b for a, b in zip(rtt, engine_ms, strict=True)]
    return {
        "n_requests": len(texts), "budget": budget, "precision": precision, "batch_window_ms": wait_ms, "client": "http.client keep-alive",
        "pairing": f"blocks of {BLOCK} texts: the engine once per text in this process, then the server on them",
        "overhead_median_ms": statistics.median(diffs), "overhead_p99_ms": pct(diffs, 0.99),
        "rtt_median_ms": statistics.median(rtt), "rtt_p99_ms": pct(rtt, 0.99),
        "engine_median_ms": statistics.median(engine_ms), "engine_p99_ms": pct(engine_ms, 0.99),
        **_where_it_goes(handler_ms, forward_ms, floor, cpu),
    }


def _where_it_goes(handler_ms: list[float], forward_ms: list[float], floor: list[float],
                   cpu: dict[str, Any]) -> dict[str, Any]:
    """Where the overhead goes: the server's own clocks, the /healthz floor and the server's CPU per request."""
    return {
        # The server's own clock around /classify (handler) and around the forward pass alone (forward), and
        # the round trip of /healthz (client, loopback TCP, uvicorn, middleware).
        "server_handler_median_ms": statistics.median(handler_ms),
        "server_forward_median_ms": statistics.median(forward_ms),
        "healthz_rtt_median_ms": statistics.median(floor),
        # The server's CPU over the timed requests, from its own counters: the part outside the forward passes
        # is what serving costs besides the model.
        "server_cpu_ms_per_request": cpu["cpu_ms_per_request"],
        "server_engine_cpu_ms_per_request": cpu["engine_cpu_ms_per_request"],
        "server_other_cpu_ms_per_request": cpu["other_cpu_ms_per_request"],
    }


def post_classify(conn: http.client.HTTPConnection, text: str, budget: float | str) -> dict[str, Any]:
    """One batch-1 POST /classify over a keep-alive connection: the answer body (any other status raises)."""
    conn.request("POST", "/classify", json.dumps({"text": text, "budget": budget}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    if r.status != 200:
        raise RuntimeError(f"/classify answered {r.status}: {body[:200]!r}")
    answer: dict[str, Any] = json.loads(body)
    return answer


async def closed_loop(url: str, texts: list[str], budget: float | Sequence[float], users: int,
                      seconds: float, forward: bool = False) -> dict[str, Any]:
    """``users`` clients, each sending its next request when the last one is answered; a sequence of budgets
    is cycled request by request (client i starts at its i-th), and the answers are counted per budget.
    ``forward``: also the median of the forward-pass time each answer reports (``latency_ms``: the engine's own,
    without HTTP, queueing or tokenizing, so the load generator sharing the cores does not enter it); off by
    default, since parsing every answer is client CPU taken from the server where they share cores."""
    budgets = [budget] if isinstance(budget, (int, float)) else list(budget)
    by_budget = dict.fromkeys(map(str, budgets), 0)
    forward_ms: dict[str, list[float]] = {str(b): [] for b in budgets}
    codes: dict[str, int] = {}
    lat: list[float] = []
    retry_after = 0
    stop = time.monotonic() + seconds

    async def user(i: int) -> None:
        nonlocal retry_after
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            j, k = i, i
            while time.monotonic() < stop:
                b = budgets[k % len(budgets)]
                t0 = time.perf_counter()
                r = await c.post("/classify", json={"text": texts[j % len(texts)], "budget": b})
                if r.status_code == 200:
                    lat.append((time.perf_counter() - t0) * 1e3)
                    by_budget[str(b)] += 1
                    if forward:
                        forward_ms[str(b)] += [res["latency_ms"] for res in r.json()["results"]]
                k += 1
                codes[str(r.status_code)] = codes.get(str(r.status_code), 0) + 1
                retry_after += r.status_code == 503 and "retry-after" in r.headers
                if r.status_code == 503:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                j += users

    t0 = time.monotonic()
    await asyncio.gather(*(user(i) for i in range(users)))
    wall = time.monotonic() - t0
    ok = codes.get("200", 0)
    return {"users": users, "rps": ok / wall, "p50_ms": pct(lat, 0.5) if lat else None,
            "p99_ms": pct(lat, 0.99) if lat else None, "codes": codes, "retry_after_on_503": retry_after,
            "answered_by_budget": by_budget,
            **({"forward_ms_p50_by_budget": {b: pct(v, 0.5) if v else None for b, v in forward_ms.items()}}
               if forward else {})}


def throughput(model: Path, texts: list[str], budget: float, workers: int, concurrency: int, duration: float,
               batching: bool, wait_ms: float) -> dict[str, Any]:
    """Requests per second served with 200 by ``workers`` under ``concurrency`` clients."""
    batch, wait = (32, wait_ms) if batching else (1, 0.0)
    with Server(model, workers, batch, wait, budget) as srv:
        asyncio.run(closed_loop(srv.url, texts[:50], budget, concurrency, 3.0))  # warm-up
        res = asyncio.run(closed_loop(srv.url, texts, budget, concurrency, duration))
    return {"micro_batching": batching, "max_batch_size": batch, "max_wait_ms": wait, **res}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m headbudget.loadtest.service_bench", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, default=Path("../shared/data/ag_news"))
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--wait-ms", type=float, default=3.0)
    p.add_argument("--precision", choices=PRECISION_NAMES, default="fp32",
                   help="the server's and the paired in-process engine's precision")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    texts = bench_texts("service_bench", args.model, args.data, args.requests)
    if texts is None:
        return 2
    from headbudget.experiments.bench import cpu_name

    result: dict[str, Any] = {"model": str(args.model), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
                              "workers": args.workers, "concurrency": args.concurrency}
    result.update(overhead(args.model, texts, args.budget, args.wait_ms, args.precision))
    result["throughput"] = [
        throughput(args.model, texts, args.budget, args.workers, args.concurrency, args.duration, b, args.wait_ms)
        for b in (True, False)
    ]
    result["rps"] = {("batching" if t["micro_batching"] else "no_batching"): t["rps"] for t in result["throughput"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "throughput"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
