"""Fairness inside a tier under load: `python -m headbudget.loadtest.fairness --model DIR --out FILE`.

Two keys of one tier (``--tier``, cheap by default; its settings, quotas included, come from ``--config``) on a real
server with 2 workers, on 127.0.0.1 only, sharing a local ``redis-server`` when one is installed (quotas exact
across the workers) or each worker keeping its own:
1. the light key alone: single short texts at a fixed rate (open loop: each request leaves on schedule and its
   latency counts from then, so a slow answer cannot slow the sending);
2. the same, while the heavy key's clients send 64 long texts per request one after another (closed loop, waiting
   out Retry-After on 429 and 503).
Writes ``light_p99_alone_ms``, ``light_p99_with_heavy_ms``, ``longest_pass_ms`` (the longest forward pass an answer
reports: the longest work a worker runs without a break, during which nothing else can start; also as
``pass_ms_max``), ``status_counts`` per key and ``light_non200``, the heavy key's answers and compute units per
minute, the bound the light key is held to (1.5 x its p99 alone plus the longest pass), and the machine, date,
commit, command and checkpoint. Exit status: 0 when nothing was answered 5xx and the light key's p99 held the bound,
1 otherwise, 2 when the run could not be made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES
from headbudget.loadtest.service_bench import Server, free_port, pct, pinned
from headbudget.service.accounting.auth import hash_key, new_key

PROG = "fairness"
WORDS = ("market shares rose after the central bank held rates steady while oil prices fell and investors weighed "
         "new data on jobs growth the team won its third match in a row as the striker scored twice before halftime "
         "scientists said the probe sent back images of the planet rings and a storm larger than earth").split()
SHORT_TEXT = "stocks rally as tech earnings beat forecasts"


# -- the server's configuration ---------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # dates and datetimes as text


def to_toml(doc: dict[str, Any], prefix: str = "") -> str:
    """TOML for a parsed configuration (scalars, lists of scalars, tables, arrays of tables)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in doc.items()
             if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict))]
    out = "\n".join(lines) + ("\n" if lines else "")
    for k, v in doc.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out += f"\n[{name}]\n" + to_toml(v, name + ".")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                out += f"\n[[{name}]]\n" + to_toml(item, name + ".")
    return out


def server_config(base: dict[str, Any], tier: str, keys: dict[str, str], redis_url: str | None) -> str:
    """``base`` (a service.toml) with ``keys`` (name -> key) as its only keys, all of ``tier``."""
    doc = json.loads(json.dumps(base, default=str))  # a deep copy
    doc["keys"] = [{"sha256": hash_key(k), "tier": tier, "name": name} for name, k in keys.items()]
    doc.pop("development", None)  # no anonymous tier: every request is one of the keys
    doc.get("state", {}).pop("journal_dir", None)  # a measurement keeps no usage journal (and writes nothing here)
    if redis_url:
        doc.setdefault("state", {})["redis_url"] = redis_url
    return to_toml(doc)


@contextmanager
def local_redis(use: bool) -> Iterator[str | None]:
    """A throwaway redis-server on a free loopback port (None when not asked for or not installed)."""
    exe = shutil.which("redis-server") if use else None
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _pong(port):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# -- the clients -----------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """What one key's requests were answered."""

    codes: dict[str, int] = field(default_factory=dict)
    latency_ms: list[float] = field(default_factory=list)  # of the 200s
    forward_ms: list[float] = field(default_factory=list)  # the longest forward pass each 200 reports
    charges: list[float] = field(default_factory=list)  # compute units each 200 was charged
    tokens: list[int] = field(default_factory=list)  # the longest text of each 200, in tokens
    retry_after: dict[str, int] = field(default_factory=dict)  # status -> answers of it that carried Retry-After

    def add(self, r: httpx.Response | None, latency_ms: float) -> None:
        """One answer (None: no answer, the connection failed or timed out)."""
        status = str(r.status_code) if r is not None else "no answer"
        self.codes[status] = self.codes.get(status, 0) + 1
        if r is None:
            return
        if "retry-after" in r.headers:
            self.retry_after[status] = self.retry_after.get(status, 0) + 1
        if r.status_code == 200:
            body = r.json()
            self.latency_ms.append(latency_ms)
            self.forward_ms.append(max(float(x["latency_ms"]) for x in body["results"]))
            self.charges.append(float(body["charge"]))
            self.tokens.append(max(int(x["n_tokens"]) for x in body["results"]))


async def open_loop(url: str, key: str, rps: float, seconds: float) -> Tally:
    """Single short texts at ``rps``, each sent on schedule whatever the earlier ones are doing."""
    tally, loop = Tally(), asyncio.get_running_loop()
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"X-API-Key": key}, limits=limits) as client:

        async def one(i: int, due: float) -> None:
            tally.add(await _post(client, {"text": f"{SHORT_TEXT} {i % 100}"}), (loop.time() - due) * 1000)

        t0, tasks = loop.time(), []
        for i in range(max(1, round(seconds * rps))):
            due = t0 + i / rps
            await asyncio.sleep(max(0.0, due - loop.time()))
            tasks.append(asyncio.create_task(one(i, due)))
        await asyncio.gather(*tasks)
    return tally


async def _post(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response | None:
    try:
        return await client.post("/classify", json=body)
    except httpx.TransportError:  # counted as "no answer"
        return None


def long_texts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def heavy_clients(url: str, key: str, users: int, texts: list[str], stop: asyncio.Event) -> Tally:
    """``users`` clients sending ``texts`` as one request after another until ``stop``, each waiting out the
    Retry-After of a 429 or 503 (until ``stop``)."""
    tally = Tally()

    async def user() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300, headers={"X-API-Key": key}) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await _post(client, {"texts": texts})
                tally.add(r, (time.perf_counter() - t0) * 1000)
                if r is not None and r.status_code in (429, 503):
                    wait = float(r.headers.get("retry-after", "1"))
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=wait)
                    except TimeoutError:
                        pass

    await asyncio.gather(*(user() for _ in range(users)))
    return tally


async def with_heavy(url: str, keys: dict[str, str], light_rps: float, seconds: float, users: int,
                     texts: list[str]) -> tuple[Tally, Tally, float]:
    """The light key's open loop while the heavy clients run (they start a second before it, stop after it), and
    the seconds the heavy clients ran."""
    stop, started = asyncio.Event(), time.perf_counter()
    heavy = asyncio.create_task(heavy_clients(url, keys["heavy"], users, texts, stop))
    await asyncio.sleep(1.0)
    light = await open_loop(url, keys["light"], light_rps, seconds)
    stop.set()
    heavy_tally = await heavy
    return light, heavy_tally, time.perf_counter() - started


# -- the run ---------------------------------------------------------------------------------------------------
def _p99(xs: list[float]) -> float | None:
    return round(pct(xs, 0.99), 3) if xs else None


def _figures(alone: Tally, light: Tally, heavy: Tally, heavy_s: float) -> dict[str, Any]:
    """The light client's latency alone and beside the heavy one (which ran ``heavy_s``), against its bound, and
    what each was charged."""
    longest = max([*alone.forward_ms, *light.forward_ms, *heavy.forward_ms], default=0.0)
    p99_alone, p99_with = _p99(alone.latency_ms), _p99(light.latency_ms)
    bound = round(1.5 * p99_alone + longest, 3) if p99_alone is not None else None
    server_errors = sum(n for t in (alone, light, heavy) for s, n in t.codes.items() if s.startswith("5"))
    return {
        "light_p99_alone_ms": p99_alone,
        "light_p99_with_heavy_ms": p99_with,
        "longest_pass_ms": round(longest, 3),
        "light_p99_bound_ms": bound,  # 1.5 x the p99 alone plus one longest pass
        "light_within_bound": p99_with is not None and bound is not None and p99_with <= bound,
        "pass_ms_max": round(longest, 3),  # the longest forward pass any answer reports
        "light_non200": sum(n for s, n in light.codes.items() if s != "200"),
        "heavy_answers_per_min": round(len(heavy.charges) * 60 / heavy_s, 2),
        "heavy_units_per_min": round(sum(heavy.charges) * 60 / heavy_s, 3),
        "status_counts": {"light_alone": alone.codes, "light": light.codes, "heavy": heavy.codes},
        "retry_after_counts": {"light_alone": alone.retry_after, "light": light.retry_after,
                               "heavy": heavy.retry_after},
        "server_errors": server_errors,
        "light_p50_alone_ms": round(pct(alone.latency_ms, 0.5), 3) if alone.latency_ms else None,
        "light_p50_with_heavy_ms": round(pct(light.latency_ms, 0.5), 3) if light.latency_ms else None,
        "light_longest_pass_ms": round(max(light.forward_ms, default=0.0), 3),
        "heavy_longest_pass_ms": round(max(heavy.forward_ms, default=0.0), 3),
        "heavy_charge_units": max(heavy.charges, default=None),
        "heavy_tokens_per_text": max(heavy.tokens, default=None),
        "light_charge_units": max(alone.charges, default=None),
    }


def measure(model: Path, config: Path, tier: str, workers: int, seconds: float, light_rps: float, heavy_users: int,
            heavy_texts: int, long_words: int, precision: str, redis: bool, command: str,
            cpus: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """Run both phases on one server; the figures and what they were measured on. ``cpus``: the cores of the
    server and of the clients (taskset lists; None: any)."""
    from headbudget.experiments.bench import code_commit, cpu_name

    base = tomllib.loads(config.read_text(encoding="utf-8"))
    if tier not in base.get("tiers", {}):
        raise ValueError(f"{config} has no tier {tier!r}")
    keys = {name: new_key() for name in ("light", "heavy", "warmup")}
    texts = long_texts(heavy_texts, long_words)
    with local_redis(redis) as redis_url, \
            Server(model, workers, config_text=server_config(base, tier, keys, redis_url), precision=precision,
                   cpus=cpus[0]) as srv, pinned(_cpu_list(cpus[1]) if cpus[1] else None):

        async def run() -> tuple[Tally, Tally, Tally, float]:
            warm = Tally()  # the workers run both shapes once before anything is timed (the quota may refuse some)
            async with httpx.AsyncClient(base_url=srv.url, timeout=300, headers={"X-API-Key": keys["warmup"]}) as c:
                for _ in range(2 * workers):
                    warm.add(await _post(c, {"texts": texts}), 0.0)
                    warm.add(await _post(c, {"text": SHORT_TEXT}), 0.0)
            if not warm.codes.get("200") or set(warm.codes) - {"200", "429"}:
                raise RuntimeError(f"the warm-up was answered {warm.codes}")
            alone = await open_loop(srv.url, keys["light"], light_rps, seconds)
            light, heavy, heavy_s = await with_heavy(srv.url, keys, light_rps, seconds, heavy_users, texts)
            return alone, light, heavy, heavy_s

        alone, light, heavy, heavy_s = asyncio.run(run())
    return {
        **_figures(alone, light, heavy, heavy_s),
        "setup": {"tier": tier, "tier_settings": base["tiers"][tier], "workers": workers,
                  "state": "redis (quotas shared by the workers)" if redis_url else "memory (a quota per worker)",
                  "seconds_per_phase": seconds, "light_rps": light_rps, "heavy_users": heavy_users,
                  "heavy_texts_per_request": heavy_texts, "long_text_words": long_words, "precision": precision,
                  "server_cpus": cpus[0], "client_cpus": cpus[1],
                  "config": str(config)},
        "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(short=False),
        "command": command,
        "checkpoint": str(model),
    }


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("checkpoints/ag_news-quick"), help="checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--config", type=Path, default=Path("service.toml"), help="tiers and server settings to serve")
    p.add_argument("--tier", default="cheap", help="the tier of both keys")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    p.add_argument("--light-rps", type=float, default=5.0,
                   help="the light key's requests per second (under the tier's rate_limit: cheap allows 10)")
    p.add_argument("--heavy-users", type=int, default=2, help="the heavy key's concurrent clients")
    p.add_argument("--heavy-texts", type=int, default=64, help="texts per heavy request")
    p.add_argument("--long-words", type=int, default=600, help="words per heavy text (truncated by the model)")
    p.add_argument("--precision", choices=PRECISION_NAMES, default="int8")
    p.add_argument("--no-redis", action="store_true", help="keep quotas per worker even if redis-server exists")
    p.add_argument("--server-cpus", metavar="LIST", help="the server's cores, as taskset takes them (e.g. 1)")
    p.add_argument("--client-cpus", metavar="LIST", help="the clients' cores (e.g. 0)")
    return p


def _cpu_list(text: str) -> set[int]:
    """A taskset core list ("0", "0,2", "0-3") as a set."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    def error(msg: str) -> int:
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2

    if not (args.model / "config.json").is_file():
        return error(f"{args.model} is not a checkpoint folder (no config.json)")
    if not args.config.is_file():
        return error(f"no configuration file {args.config}")
    numbers = {"--workers": args.workers, "--seconds": args.seconds, "--light-rps": args.light_rps,
               "--heavy-users": args.heavy_users, "--heavy-texts": args.heavy_texts, "--long-words": args.long_words}
    bad = [k for k, v in numbers.items() if not (math.isfinite(v) and v > 0)]
    if bad:
        return error(f"{bad[0]} must be a positive number")
    if args.heavy_texts > 64:
        return error("--heavy-texts must be at most 64 (texts per request)")
    try:
        doc = measure(args.model, args.config, args.tier, args.workers, args.seconds, args.light_rps,
                      args.heavy_users, args.heavy_texts, args.long_words, args.precision, not args.no_redis,
                      " ".join(["python -m headbudget.loadtest.fairness", *(sys.argv[1:] if argv is None else argv)]),
                      (args.server_cpus, args.client_cpus))
    except (ValueError, OSError, RuntimeError, tomllib.TOMLDecodeError, httpx.HTTPError) as e:
        return error(str(e).splitlines()[0] if str(e) else type(e).__name__)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("light_p99_alone_ms", "light_p99_with_heavy_ms", "longest_pass_ms",
                                          "light_p99_bound_ms", "status_counts")}, indent=2))
    return 0 if doc["server_errors"] == 0 and doc["light_within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
