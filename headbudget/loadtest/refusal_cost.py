"""What a refused request costs the server: `python -m headbudget.loadtest.refusal_cost --model DIR --out FILE`.

A real `headbudget serve` (one worker) with one key per way of refusing, each sent the same body again and again:
64 texts of 600 words (cut at 512 tokens), the largest `/classify` admits. Cases: ``rate`` (the key's request rate
is spent by a short first request), ``quota`` (its compute quota is spent by one admitted request of the body),
``cap`` (the body is over the tier's ``max_request_compute``), ``unknown_key`` (401); and, for reference, what
any request costs: ``tiny_401``, a 25-byte body with an unknown key.

As a flood comes: the body is encoded once and sent as bytes, by C keep-alive connections each sending its next
request as soon as its answer comes (at each of ``--conc``; with ``--pause-ms``, that long after), after
``--warmup`` requests a case. Server and client
are pinned to different cores where there are two (``--no-pin``: not), as `loadtest.concurrency` measures; cases
concurrencies and pauses alternate within each of ``--rounds``. Server CPU per refused request comes from the server's
process tree (its processes' CPU clocks) around ``--requests`` requests. The file holds ``[{"case", "conc",
"pause_ms", "round", "body", "status", "cpu_ms", "per_s"}]`` (``per_s``: refusals a second as the client saw them) with the
machine, date and commit.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES
from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest import wire
from headbudget.loadtest.fairness import long_texts, to_toml
from headbudget.loadtest.service_bench import Server, pinned, tree_cpu_s
from headbudget.service.accounting.auth import hash_key, new_key

PROG = "refusal_cost"
BODY = "64 texts x 600 words (512 tokens each after the cut)"
TINY = {"text": "a short text"}
# Tier settings per case, all metered as every shipped tier is; the body costs about 38,000 units at budget 1. The
# rate key gets one request in a thousand hours: none of its flood is ever admitted (and run).
CASES: dict[str, dict[str, Any]] = {
    "rate": {"rate_limit": 1e-3, "burst": 1, "compute_per_minute": 100000},
    "quota": {"rate_limit": 600000, "burst": 100000, "compute_per_minute": 0.001, "compute_burst": 50000},
    "cap": {"rate_limit": 600000, "burst": 100000, "compute_per_minute": 100000, "max_request_compute": 100},
}
SERVER_CPU, CLIENT_CPU = 1, 0


def config(keys: dict[str, str]) -> str:
    tiers = {case: {"default_budget": 1.0, "max_budget": 1.0, "priority": 0, "max_queue": 64, **fields}
             for case, fields in CASES.items()}
    return to_toml({"server": {"max_wait_ms": 3}, "tiers": tiers,
                    "keys": [{"sha256": hash_key(k), "tier": case, "name": case} for case, k in keys.items()]})


def flood(port: int, key: str, body: bytes, conc: int, requests: int, pause_s: float = 0.0) -> dict[int, int]:
    """Status codes of ``requests`` requests of ``body`` sent over ``conc`` keep-alive connections in a closed loop,
    each waiting ``pause_s`` after an answer: one prepared request over ``wire`` connections."""
    request = wire.post("/classify", {"X-API-Key": key}, body)
    codes: dict[int, int] = {}
    left = [requests]
    lock = threading.Lock()

    def user(_i: int) -> None:
        with wire.Connection(port) as conn:
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                status, _ = conn.send(request)
                with lock:
                    codes[status] = codes.get(status, 0) + 1
                if pause_s:
                    time.sleep(pause_s)

    wire.in_threads(user, conc)
    return codes


def measure(model: Path, precision: str, requests: int, concs: list[int], pauses_ms: list[float], rounds: int,
            warmup: int, pin: bool) -> list[dict[str, Any]]:
    keys = {case: new_key() for case in CASES}
    body = json.dumps({"texts": long_texts(64, 600)}).encode()
    rows = []
    with Server(model, 1, config_text=config(keys), precision=precision,
                cpus=str(SERVER_CPU) if pin else None) as srv, pinned({CLIENT_CPU} if pin else None):
        with httpx.Client(base_url=srv.url, timeout=600) as client:
            # Spend what each case refuses on: the rate key's one request, the quota key's compute
            assert client.post("/classify", json={"text": "a short text"},
                               headers={"X-API-Key": keys["rate"]}).is_success
            for _ in range(100):  # the body until the quota refuses it (one on MiniLM: about 38,000 of 50,000 units)
                r = client.post("/classify", content=body,
                                headers={"X-API-Key": keys["quota"], "Content-Type": "application/json"})
                if r.status_code == 429:
                    break
        tiny = json.dumps(TINY).encode()
        cases = {**{case: (key, body, BODY) for case, key in keys.items()},
                 "unknown_key": (new_key(), body, BODY), "tiny_401": (new_key(), tiny, f"{len(tiny)} bytes")}
        for key, sent, _ in cases.values():  # first-time costs (imports, caches) are not a refusal's
            flood(srv.port, key, sent, 1, warmup)
        for rnd in range(1, rounds + 1):
            for pause_ms in pauses_ms:
                for conc in concs:
                    for case, (key, sent, label) in cases.items():
                        before, t0 = tree_cpu_s(srv.proc.pid), time.monotonic()
                        codes = flood(srv.port, key, sent, conc, requests, pause_ms / 1e3)
                        wall, cpu_s = time.monotonic() - t0, tree_cpu_s(srv.proc.pid) - before
                        rows.append({"case": case, "conc": conc, "pause_ms": pause_ms, "round": rnd, "body": label,
                                     "status": {str(k): v for k, v in sorted(codes.items())},
                                     "cpu_ms": round(cpu_s * 1e3 / requests, 3),
                                     "per_s": round(requests / wall, 1)})
                        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--precision", default="int8", choices=PRECISION_NAMES)
    p.add_argument("--requests", type=int, default=100, help="requests a case, concurrency and round")
    p.add_argument("--conc", default="1,4", help="connections, comma-separated (default 1,4)")
    p.add_argument("--pause-ms", default="0", help="each connection's pause after an answer, comma-separated "
                   "(default 0: a flood)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10, help="requests a case before the rounds")
    p.add_argument("--no-pin", action="store_true", help="leave server and client where the system puts them")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    problem = None
    try:
        concs = [int(c) for c in args.conc.split(",")]
    except ValueError:
        concs = []
    try:
        pauses = [float(c) for c in args.pause_ms.split(",")]
    except ValueError:
        pauses = []
    if not (args.model / "config.json").is_file():
        problem = f"no checkpoint in {args.model}"
    elif not args.out.parent.is_dir():
        problem = f"--out: folder {args.out.parent} does not exist"
    elif args.requests < 1 or args.rounds < 1 or args.warmup < 0:
        problem = "--requests and --rounds must be positive, --warmup at least 0"
    elif not concs or min(concs) < 1:
        problem = f"--conc: positive integers separated by commas, got {args.conc!r}"
    elif not pauses or not all(0 <= p <= 10_000 for p in pauses):
        problem = f"--pause-ms: milliseconds from 0 to 10000 separated by commas, got {args.pause_ms!r}"
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2 and {SERVER_CPU, CLIENT_CPU} <= os.sched_getaffinity(0)
    rows = measure(args.model, args.precision, args.requests, concs, pauses, args.rounds, args.warmup, pin)
    args.out.write_text(json.dumps({
        "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(), "precision": args.precision,
        "workers": 1, "requests": args.requests, "warmup": args.warmup,
        "pinned": {"server_cpu": SERVER_CPU, "client_cpu": CLIENT_CPU} if pin else None, "rows": rows,
        "command": f"python -m headbudget.loadtest.{PROG} " + " ".join(sys.argv[1:] if argv is None else argv)},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
