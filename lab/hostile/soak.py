"""A soak: mixed, partly hostile traffic at about 80% of the server's measured capacity, for as long as asked.

One worker, or two replicas behind haproxy (round robin, health-checked), both on one redis-server. The traffic,
open loop: the three tiers at grid, off-grid and default budgets, `auto` and `max_latency_ms`, TEI `/predict`, bodies
over the size limit and malformed ones, unknown and revoked keys, a key over its compute quota; beside it slow
clients (a body a byte a second) and idle connections held open; a SIGHUP to every server each minute and Redis
restarted once, mid-run. What it reads: every answer's status, time and charge; each server's resident memory,
open files and threads; at the end each key's usage, which must equal the charges its 200s carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from headbudget.loadtest.fairness import to_toml
from headbudget.loadtest.faults import Redis, wait_until
from headbudget.loadtest.haproxy import haproxy_config
from headbudget.loadtest.service_bench import free_port
from headbudget.service.accounting.auth import hash_key, new_key

HOST = "127.0.0.1"
CONNECTIONS = 64  # the open loop's keep-alive connections
TEXTS = ("Stocks rallied after the central bank left interest rates unchanged.",
         "The striker scored twice in the final minutes of the match against the league leaders.",
         "Scientists said the probe sent back images of the planet's rings.",
         "Oil prices fell as investors weighed new data on jobs growth and inflation.",
         "The company unveiled a new chip that it says doubles battery life in laptops.",
         "Rain delayed the final round of the golf tournament by three hours.")
# (kind, weight): what one request of the mix is
MIX = (("balanced_grid", 22), ("light", 12), ("off_grid", 8), ("auto", 7), ("latency", 7), ("quality", 6),
       ("tei", 10), ("tei_batch", 4), ("oversized", 2), ("malformed", 5), ("unknown_key", 4), ("revoked_key", 3),
       ("quota", 10))
TIERS = {"cheap": {"default_budget": 0.25, "max_budget": 0.5, "priority": 0},
         "balanced": {"default_budget": 0.5, "max_budget": 1.0, "priority": 5},
         "quality": {"default_budget": 1.0, "max_budget": 1.0, "priority": 10}}


@dataclass
class Keys:
    """The soak's keys: one per role."""

    balanced: str = field(default_factory=new_key)
    light: str = field(default_factory=new_key)  # cheap tier, light traffic: its p99 is watched
    quality: str = field(default_factory=new_key)
    quota: str = field(default_factory=new_key)  # a tier with a compute quota it keeps running into
    revoked: str = field(default_factory=new_key)
    slow: str = field(default_factory=new_key)  # the slow clients'

    def metered(self) -> dict[str, str]:
        return {"balanced": self.balanced, "light": self.light, "quality": self.quality, "quota": self.quota,
                "slow": self.slow}


def config_doc(keys: Keys, redis_url: str, journal: Path, quota_units: float = 10 ** 6) -> dict[str, Any]:
    tiers = {name: {**t, "rate_limit": 600_000, "burst": 10_000, "max_queue": 256} for name, t in TIERS.items()}
    tiers["metered"] = {**tiers["balanced"], "compute_per_minute": quota_units}
    return {"server": {"max_wait_ms": 2.0},
            "state": {"redis_url": redis_url, "on_error": "open", "journal_dir": str(journal)},
            "tiers": tiers,
            "keys": [{"sha256": hash_key(keys.balanced), "tier": "balanced", "name": "soak-balanced"},
                     {"sha256": hash_key(keys.light), "tier": "cheap", "name": "soak-light"},
                     {"sha256": hash_key(keys.quality), "tier": "quality", "name": "soak-quality"},
                     {"sha256": hash_key(keys.quota), "tier": "metered", "name": "soak-quota"},
                     {"sha256": hash_key(keys.revoked), "tier": "balanced", "name": "soak-revoked",
                      "revoked": True},
                     {"sha256": hash_key(keys.slow), "tier": "balanced", "name": "soak-slow"}]}


class Servers:
    """One `headbudget serve`, or two behind haproxy; ``url`` is where clients go, ``pids`` the servers."""

    def __init__(self, model: Path, config: Path, folder: Path, replicas: int, precision: str) -> None:
        self.folder, self.procs = folder, []
        ports = [free_port() for _ in range(replicas)]
        for i, port in enumerate(ports):
            cmd = [sys.executable, "-m", "headbudget.cli", "serve", "--model", str(model), "--config", str(config),
                   "--host", HOST, "--port", str(port), "--workers", "1", "--precision", precision]
            with open(folder / f"server-{i}.log", "ab") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                                   start_new_session=True,
                                                   env={**os.environ, "OMP_NUM_THREADS": "1"}))
        for port in ports:
            wait_until(lambda p=port: _ready(f"http://{HOST}:{p}"), 300, "a server")
        self.haproxy: subprocess.Popen[bytes] | None = None
        if replicas == 1:
            self.url = f"http://{HOST}:{ports[0]}"
            return
        front = free_port()
        cfg = folder / "haproxy.cfg"
        cfg.write_text(haproxy_config(HOST, front, [(f"r{i}", p) for i, p in enumerate(ports)]))
        exe = _which("haproxy")
        with open(folder / "haproxy.log", "ab") as log:
            self.haproxy = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.url = f"http://{HOST}:{front}"
        wait_until(lambda: _ready(self.url), 30, "haproxy")

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def sighup(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGHUP)

    def sample(self) -> dict[str, float]:
        """Resident MB, open files and threads, summed over every server's process tree."""
        rss = fds = threads = 0.0
        for pid in self.pids():
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        rss += proc.memory_info().rss / 2**20
                        fds += proc.num_fds()
                        threads += proc.num_threads()
        return {"rss_mb": rss, "fds": fds, "threads": threads}

    def stop(self) -> None:
        for p in [*self.procs, *([self.haproxy] if self.haproxy else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in [*self.procs, *([self.haproxy] if self.haproxy else [])]:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)


def _which(exe: str) -> str:
    import shutil

    path = shutil.which(exe, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if path is None:
        raise RuntimeError(f"{exe} is not installed (Debian package {exe}; `make system-deps`)")
    return path


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Answer:
    t: float  # seconds since the soak's start
    kind: str
    key: str  # the metered key's role, or ""
    status: int  # 0: no answer (a transport error)
    ms: float
    charge_milli: int  # the 200's charge in milli-units
    retry_after: bool


def request_of(kind: str, keys: Keys, rng: random.Random) -> tuple[str, str, dict[str, str], bytes]:
    """(role of the key, path with query, headers, body) for one request of ``kind``."""
    text = rng.choice(TEXTS)
    js = {"Content-Type": "application/json"}

    def body(d: Any) -> bytes:
        return json.dumps(d).encode()

    if kind == "balanced_grid":
        return "balanced", f"/classify?budget={rng.choice((0.25, 0.5, 0.75, 1.0))}", \
            {**js, "X-API-Key": keys.balanced}, body({"text": text})
    if kind == "light":
        return "light", "/classify", {**js, "X-API-Key": keys.light}, body({"text": text})
    if kind == "off_grid":
        return "balanced", "/classify", {**js, "X-API-Key": keys.balanced}, \
            body({"texts": [text, rng.choice(TEXTS)], "budget": rng.choice((0.37, 0.615, 0.1234, 0.88))})
    if kind == "auto":
        return "balanced", "/classify?budget=auto&max_budget=0.75", {**js, "X-API-Key": keys.balanced}, \
            body({"text": text})
    if kind == "latency":
        return "balanced", f"/classify?max_latency_ms={rng.choice((3, 8, 20, 50))}", \
            {**js, "X-API-Key": keys.balanced}, body({"text": text})
    if kind == "quality":
        return "quality", "/classify", {**js, "X-API-Key": keys.quality}, body({"text": text})
    if kind == "tei":
        return "balanced", "/predict", {**js, "X-API-Key": keys.balanced}, body({"inputs": text})
    if kind == "tei_batch":
        return "balanced", "/predict?budget=0.5", {**js, "X-API-Key": keys.balanced}, \
            body({"inputs": [[text], [rng.choice(TEXTS)]]})
    if kind == "oversized":
        return "", "/classify", {**js, "X-API-Key": keys.balanced}, body({"texts": ["word " * 40_000] * 8})
    if kind == "malformed":
        bad = rng.choice((b'{"text": ', b'{"text": 5}', b'{"texts": []}', b'{"text": "a", "budget": NaN}',
                          b"\xff\xfe", b'{"text": "a", "budget": 7}'))
        return "", "/classify", {**js, "X-API-Key": keys.balanced}, bad
    if kind == "unknown_key":
        return "", "/classify", {**js, "X-API-Key": new_key()}, body({"text": text})
    if kind == "revoked_key":
        return "", "/classify", {**js, "X-API-Key": keys.revoked}, body({"text": text})
    if kind == "quota":
        return "quota", "/classify?budget=1", {**js, "X-API-Key": keys.quota}, body({"texts": [text] * 4})
    raise ValueError(kind)


async def _send(client: httpx.AsyncClient, kind: str, keys: Keys, rng: random.Random, t0: float,
                out: list[Answer], scheduled: float | None = None) -> None:
    """One request; its time runs from ``scheduled`` (the open loop's arrival) when given, so that a request
    waiting for a free connection counts its wait."""
    role, path, headers, body = request_of(kind, keys, rng)
    start = time.monotonic() if scheduled is None else scheduled
    try:
        r = await client.post(path, headers=headers, content=body)
        status, charge = r.status_code, 0
        if status == 200 and path.startswith("/classify"):
            charge = round(float(r.json()["charge"]) * 1000)
        elif status == 200:  # TEI: the charge is in the header
            charge = round(float(r.headers.get("x-charge", "0")) * 1000)
        retry = "retry-after" in r.headers
    except httpx.HTTPError:
        status, charge, retry = 0, 0, False
    out.append(Answer(start - t0, kind, role, status, (time.monotonic() - start) * 1000, charge, retry))


def kinds(rng: random.Random, n: int) -> list[str]:
    names, weights = zip(*MIX, strict=True)
    return rng.choices(names, weights=weights, k=n)


async def closed_loop(url: str, keys: Keys, users: int, seconds: float) -> float:
    """Answers per second of the mix with ``users`` closed loops: the capacity the soak runs at a share of."""
    out: list[Answer] = []
    rng = random.Random(1)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=users)) as c:
        async def user() -> None:
            while time.monotonic() - t0 < seconds:
                await _send(c, kinds(rng, 1)[0], keys, rng, t0, out)
        await asyncio.gather(*(user() for _ in range(users)))
    return len(out) / (time.monotonic() - t0)


async def slow_client(port: int, stop: asyncio.Event, key: str, t0: float, out: list[Answer]) -> None:
    """A body sent a byte a second, again and again: the server must not hold engine time or others for it."""
    body = json.dumps({"text": "slow"}).encode()
    head = (f"POST /classify HTTP/1.1\r\nHost: soak\r\nX-API-Key: {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    while not stop.is_set():
        try:
            start = time.monotonic()
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(head)
            for b in body:
                writer.write(bytes([b]))
                await writer.drain()
                await asyncio.sleep(1.0)
            reply = b""
            with contextlib.suppress(asyncio.TimeoutError):
                reply = await asyncio.wait_for(reader.read(65536), 30)
            writer.close()
            status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
            charge = round(float(json.loads(reply.split(b"\r\n\r\n", 1)[1])["charge"]) * 1000) \
                if status == 200 else 0
            out.append(Answer(start - t0, "slow", "slow", status, (time.monotonic() - start) * 1000, charge,
                              b"retry-after" in reply.lower()))
        except (OSError, ValueError, IndexError, KeyError):
            await asyncio.sleep(1.0)


async def idle_connection(port: int, stop: asyncio.Event) -> None:
    """A connection opened and never written to, opened again whenever the server closes it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(1), 30)
            writer.close()
        except OSError:
            await asyncio.sleep(1.0)


def _p99(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(0.99 * len(s)))], 2)


def _usage_milli(url: str, key: str) -> int:
    for _ in range(30):
        r = httpx.get(f"{url}/v1/usage", headers={"X-API-Key": key}, timeout=30)
        if r.status_code == 200:
            return round(float(r.json()["today"]["units"]) * 1000)
        time.sleep(1.0)
    raise RuntimeError(f"/v1/usage answered {r.status_code}")


async def _restart(redis: Redis, down_s: float) -> None:
    await asyncio.to_thread(redis.stop)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(redis.start)


async def _soak(servers: Servers, redis: Redis, keys: Keys, rps: float, seconds: float, hup_every_s: float,
                samples: list[dict[str, float]]) -> list[Answer]:
    port = int(servers.url.rsplit(":", 1)[1])
    stop = asyncio.Event()
    rng = random.Random(7)
    t0 = time.monotonic()
    out: list[Answer] = []
    background = [asyncio.create_task(slow_client(port, stop, keys.slow, t0, out)) for _ in range(4)]
    background += [asyncio.create_task(idle_connection(port, stop)) for _ in range(8)]
    next_hup, redis_at, redis_done = hup_every_s, seconds / 2, False
    # Arrivals go to a queue that a fixed set of connections serves: a backlog waits there at no cost, where a
    # connection pool with hundreds of waiters spends the client's CPU on its own bookkeeping.
    arrivals: asyncio.Queue[tuple[float, str] | None] = asyncio.Queue()

    async def connection() -> None:
        async with httpx.AsyncClient(base_url=servers.url, timeout=60,
                                     limits=httpx.Limits(max_connections=1)) as client:
            while (item := await arrivals.get()) is not None:
                await _send(client, item[1], keys, rng, t0, out, scheduled=item[0])

    workers = [asyncio.create_task(connection()) for _ in range(CONNECTIONS)]
    n = 0
    while (now := time.monotonic() - t0) < seconds:
        if now >= next_hup:
            servers.sighup()
            next_hup += hup_every_s
        if not redis_done and now >= redis_at:  # beside the load, which goes on meanwhile
            redis_done = True
            background.append(asyncio.create_task(_restart(redis, 3.0)))
        if len(samples) <= now // 10:
            samples.append({"t": round(now, 1), **servers.sample()})
        n += 1
        due = n / rps
        if due > now:
            await asyncio.sleep(due - now)
        arrivals.put_nowait((t0 + due, kinds(rng, 1)[0]))
    for _ in workers:
        arrivals.put_nowait(None)
    await asyncio.gather(*workers)
    stop.set()
    restart = background.pop() if redis_done else None
    if restart is not None:
        await restart  # Redis is back before the books are read
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    samples.append({"t": round(time.monotonic() - t0, 1), **servers.sample()})
    return out


def run(model: Path, folder: Path, *, replicas: int, seconds: float, precision: str = "int8",
        share: float = 0.8, warmup_s: float = 60.0, window_s: float = 300.0, quota_requests: float = 30.0,
        capacity_s: float = 15.0, hup_every_s: float = 60.0) -> dict[str, Any]:
    """One soak; the row of hostile-hour.json's ``soak``."""
    folder.mkdir(parents=True, exist_ok=True)
    redis = Redis(folder)
    keys = Keys()
    journal = folder / "journal"
    config = folder / "service.toml"
    redis.start()
    config.write_text(to_toml(config_doc(keys, redis.url, journal)))
    servers = Servers(model, config, folder, replicas, precision)
    try:
        capacity = asyncio.run(closed_loop(servers.url, keys, 16, capacity_s))
        rps = share * capacity
        # the quota key's tier allows about quota_requests of its requests a minute: measured, then reloaded
        _, path, headers, body = request_of("quota", keys, random.Random(0))
        one = httpx.post(servers.url + path, headers={**headers, "X-API-Key": keys.balanced}, content=body,
                         timeout=60).json()["charge"]
        config.write_text(to_toml(config_doc(keys, redis.url, journal, quota_requests * float(one))))
        servers.sighup()
        time.sleep(1.0)
        baseline = {k: _usage_milli(servers.url, v) for k, v in keys.metered().items()}
        samples: list[dict[str, float]] = []
        answers = asyncio.run(_soak(servers, redis, keys, rps, seconds, hup_every_s, samples))
        time.sleep(2.0)
        usage = {k: _usage_milli(servers.url, v) - baseline[k] for k, v in keys.metered().items()}
        logs = "".join((folder / f"server-{i}.log").read_text(errors="replace") for i in range(replicas))
    finally:
        servers.stop()
        redis.stop()
    with open(folder / "answers.jsonl", "w") as f:  # every answer, for windows other than the two reported
        f.writelines(json.dumps(a.__dict__) + "\n" for a in answers)
    (folder / "samples.json").write_text(json.dumps(samples))
    after = [s for s in samples if s["t"] >= warmup_s] or samples
    charged = {k: sum(a.charge_milli for a in answers if a.key == k and a.status == 200) for k in usage}
    light = [a for a in answers if a.kind == "light" and a.status == 200]
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a.status)] = statuses.get(str(a.status), 0) + 1
    server_errors = sum(1 for a in answers if a.status >= 500 and not (a.status == 503 and a.retry_after))
    return {"seconds": round(seconds), "workers": replicas, "capacity_rps": round(capacity, 1),
            "target_rps": round(rps, 1), "answers": len(answers),
            "achieved_rps": round(len(answers) / seconds, 1), "statuses": statuses,
            "rss_start_mb": round(after[0]["rss_mb"], 1), "rss_end_mb": round(after[-1]["rss_mb"], 1),
            "rss_growth_pct": round(100 * (after[-1]["rss_mb"] / after[0]["rss_mb"] - 1), 2),
            "light_p99_first_ms": _p99([a.ms for a in light if warmup_s <= a.t < warmup_s + window_s]),
            "light_p99_last_ms": _p99([a.ms for a in light if a.t >= seconds - window_s]),
            "server_errors": server_errors,
            "shed_503_with_retry_after": sum(1 for a in answers if a.status == 503 and a.retry_after),
            "no_answer": statuses.get("0", 0),
            "usage_minus_answers_units": round(sum(usage.values()) - sum(charged.values())) / 1000,
            "usage_by_key_units": {k: usage[k] / 1000 for k in usage},
            "answers_by_key_units": {k: charged[k] / 1000 for k in charged},
            "fds_start": after[0]["fds"], "fds_end": after[-1]["fds"],
            "threads_start": after[0]["threads"], "threads_end": after[-1]["threads"],
            "slow_requests_answered": sum(1 for a in answers if a.kind == "slow" and a.status == 200),
            "tracebacks_in_logs": logs.count("Traceback")}


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=1800)
    p.add_argument("--replicas", type=int, default=1, choices=(1, 2))
    p.add_argument("--folder", type=Path, default=Path("runs/soak"))
    a = p.parse_args()
    print(json.dumps(run(a.model, a.folder, replicas=a.replicas, seconds=a.seconds), indent=2))
