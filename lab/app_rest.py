"""What the app costs around the engine without HTTP: `python -m lab.app_rest --model CKPT --data DIR --out F`.

The service's ASGI app (`create_app`, the engine `headbudget serve` loads, one thread) is called in this process,
without uvicorn: one request at a time, each one text of ``test.csv`` in file order, at each of ``--budgets``, with
a key of ``--tier`` (metered, as the shipped tiers are; its rate and quota lifted out of reach). Per request, over
``--requests`` requests and ``--rounds`` rounds: the process's CPU, the engine's
(``headbudget_engine_cpu_seconds_total``: the forward passes and tokenizing, wherever it ran), the event loop
thread's (pricing tokenizes there), and the serving rest, the process's less the engine's. Set beside the serving
rest a real server reports (`loadtest.concurrency`), the difference is what uvicorn and HTTP add.

``refusals``: the same for a 64 x 600-word body refused by a spent compute quota and by an unknown key (401), the
cases of `loadtest.refusal_cost`, so that the price of reading and pricing such a body is seen without HTTP.
"""

from __future__ import annotations

import asyncio
import csv
import json
import statistics
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES
from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest.fairness import long_texts
from headbudget.loadtest.refusal_cost import CASES
from headbudget.loadtest.refusal_cost import config as refusal_config
from headbudget.service.accounting.auth import hash_key, new_key
from headbudget.service.app import create_app, default_engine_factory
from headbudget.service.logs import configure_logging
from headbudget.service.settings import ServeSettings, ServiceConfig, load_config, parse_config
from lab.script_output import check_out, write_doc

PROG = "python -m lab.app_rest"
Call = Callable[[str, bytes, bytes], Awaitable[int]]


def asgi_caller(app: Any) -> Call:
    """POST /classify?QUERY with a body and a key straight into the app; returns the status."""

    async def call(key: str, query: bytes, body: bytes) -> int:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/classify", "raw_path": b"/classify", "query_string": query,
                 "root_path": "", "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8000),
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode()), (b"x-api-key", key.encode())]}
        sent = False
        status: list[int] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays until the answer
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await app(scope, receive, send)
        return status[0]

    return call


def _engine_cpu_s(app: Any) -> float:
    counter = app.state.runtime.metrics.engine_cpu_seconds
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


Case = tuple[str, str, bytes, list[bytes], int]  # name, key, query, the bodies sent in turn, the status expected


async def _measure(app: Any, cases: list[Case], requests: int, rounds: int, log: Callable[[str], None],
                   prepare: Callable[[Call], Awaitable[None]] | None = None) -> list[dict[str, Any]]:
    """Per case: medians over rounds of CPU ms per request. ``prepare`` runs first, with the app started."""
    call = asgi_caller(app)
    rows = []
    async with app.router.lifespan_context(app):
        if prepare is not None:
            await prepare(call)
        for name, key, query, bodies, expected in cases:
            for i in range(min(20, requests)):  # warm: sessions, caches, the latency model
                await call(key, query, bodies[i % len(bodies)])
            parts: dict[str, list[float]] = {"rest_ms": [], "loop_ms": [], "engine_ms": [], "process_ms": []}
            for _ in range(rounds):
                t0, p0, eng0 = time.thread_time(), time.process_time(), _engine_cpu_s(app)
                for i in range(requests):
                    status = await call(key, query, bodies[i % len(bodies)])
                    if status != expected:
                        raise RuntimeError(f"{name}: status {status}, expected {expected}")
                engine, process = _engine_cpu_s(app) - eng0, time.process_time() - p0
                parts["rest_ms"].append((process - engine) * 1e3 / requests)
                parts["loop_ms"].append((time.thread_time() - t0) * 1e3 / requests)
                parts["engine_ms"].append(engine * 1e3 / requests)
                parts["process_ms"].append(process * 1e3 / requests)
            row = {"case": name, "status": expected, **{k: round(statistics.median(v), 3) for k, v in parts.items()}}
            rows.append(row)
            log(" ".join(f"{k}={v}" for k, v in row.items()))
    return rows


def lifted(config: ServiceConfig, tier: str) -> ServiceConfig:
    """``config`` with ``tier``'s request rate and compute quota out of reach, so that no request of the run is
    refused: a metered tier stays metered (priced and charged), as the shipped ones are."""
    doc = config.model_dump(mode="json")
    doc["tiers"][tier].update(rate_limit=1e9, burst=1_000_000)
    if doc["tiers"][tier].get("compute_per_minute") is not None:
        doc["tiers"][tier].update(compute_per_minute=1e8, compute_burst=1e8)
    return parse_config(doc)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, help="a folder with test.csv (text, label); needed for `answered`")
    ap.add_argument("--config", type=Path, default=Path("service.toml"), help="tiers for `answered`")
    ap.add_argument("--tier", default="balanced")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--mode", choices=["answered", "refusals"], default="answered")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="int8", choices=PRECISION_NAMES)
    ap.add_argument("--access-log", type=Path, help="write the access records there, as `serve --access-log` does")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        check_out(args.out)
        if args.mode == "answered" and (args.data is None or not (args.data / "test.csv").is_file()):
            raise ValueError(f"no test.csv in {args.data}")
        config = load_config(args.config) if args.mode == "answered" else None
        if config is not None and args.tier not in config.tiers:
            raise ValueError(f"tier {args.tier!r} is not in {args.config} ({', '.join(config.tiers)})")
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    settings = ServeSettings(model_dir=args.model, config_path=args.config, precision=args.precision)
    # warning keeps the app's own lines off the measurement's output; an access log file is written at any level
    configure_logging("WARNING", args.access_log)
    prepare: Callable[[Call], Awaitable[None]] | None = None
    if args.mode == "answered":
        assert config is not None and args.data is not None
        with open(args.data / "test.csv", encoding="utf-8", newline="") as f:
            texts = [r["text"] for r in csv.DictReader(f) if r["text"].strip()][:args.requests]
        key = new_key()
        config = lifted(config, args.tier)
        app = create_app(config, default_engine_factory(settings, config.default_budgets()),
                         extra_key_hashes={hash_key(key): args.tier})
        bodies = [json.dumps({"text": t}).encode() for t in texts]
        cases: list[Case] = [(f"answered b={b:g}", key, f"budget={b:g}".encode(), bodies, 200) for b in args.budgets]
    else:
        keys = {case: new_key() for case in CASES}
        config = parse_config(tomllib.loads(refusal_config(keys)))
        app = create_app(config, default_engine_factory(settings, config.default_budgets()))
        body = json.dumps({"texts": long_texts(64, 600)}).encode()
        cases = [("quota", keys["quota"], b"", [body], 429), ("cap", keys["cap"], b"", [body], 422),
                 ("unknown_key", new_key(), b"", [body], 401)]

        async def spend_quota(call: Call) -> None:  # admitted requests of the body spend the quota key's compute
            for _ in range(10):
                if await call(keys["quota"], b"", body) == 429:
                    return
            raise RuntimeError("the quota key was never refused")

        prepare = spend_quota
    rows = asyncio.run(_measure(app, cases, args.requests, args.rounds, lambda line: print(line, flush=True),
                                prepare))
    write_doc({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(),
               "precision": args.precision, "mode": args.mode, "access_log": args.access_log is not None,
               "requests": args.requests, "rounds": args.rounds, "rows": rows}, args.out, "app_rest", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
