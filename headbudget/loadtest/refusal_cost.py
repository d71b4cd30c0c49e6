"""What a refused request costs the server: `python -m headbudget.loadtest.refusal_cost --model DIR --out FILE`.

A real `headbudget serve` (one worker) with one key per way of refusing, each sent the same body again and again:
64 texts of 600 words (cut at 512 tokens), the largest `/classify` admits. Cases: ``rate`` (the key's request rate
is spent by a short first request), ``quota`` (its compute quota is spent by one admitted request of the body),
``cap`` (the body is over the tier's ``max_request_compute``), ``unknown_key`` (401). Server CPU per refused request
comes from the server's process tree (its processes' CPU clocks), around ``--requests`` sequential requests per
case. The file holds ``[{"case", "body", "status", "cpu_ms"}]`` with the machine, date and commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest.fairness import long_texts, to_toml
from headbudget.loadtest.service_bench import Server, tree_cpu_s
from headbudget.service.auth import hash_key, new_key

PROG = "refusal_cost"
BODY = "64 texts x 600 words (512 tokens each after the cut)"
# Tier settings per case, all metered as every shipped tier is; the body costs about 38,000 units at budget 1
CASES: dict[str, dict[str, Any]] = {
    "rate": {"rate_limit": 1, "burst": 1, "compute_per_minute": 100000},
    "quota": {"rate_limit": 600000, "burst": 100000, "compute_per_minute": 0.001, "compute_burst": 50000},
    "cap": {"rate_limit": 600000, "burst": 100000, "compute_per_minute": 100000, "max_request_compute": 100},
}


def config(keys: dict[str, str]) -> str:
    tiers = {case: {"default_budget": 1.0, "max_budget": 1.0, "priority": 0, "max_queue": 64, **fields}
             for case, fields in CASES.items()}
    return to_toml({"server": {"max_wait_ms": 3}, "tiers": tiers,
                    "keys": [{"sha256": hash_key(k), "tier": case, "name": case} for case, k in keys.items()]})


def measure(model: Path, precision: str, requests: int) -> list[dict[str, Any]]:
    keys = {case: new_key() for case in CASES}
    body = {"texts": long_texts(64, 600)}
    rows = []
    with Server(model, 1, config_text=config(keys), precision=precision) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as client:
        # Spend what each case refuses on: the rate key's one request, the quota key's compute
        assert client.post("/classify", json={"text": "a short text"}, headers={"X-API-Key": keys["rate"]}).is_success
        for _ in range(100):  # the body until the quota refuses it (one on MiniLM: about 38,000 of 50,000 units)
            if client.post("/classify", json=body, headers={"X-API-Key": keys["quota"]}).status_code == 429:
                break
        for case, key in [*keys.items(), ("unknown_key", new_key())]:
            codes: dict[int, int] = {}
            before = tree_cpu_s(srv.proc.pid)
            for _ in range(requests):
                r = client.post("/classify", json=body, headers={"X-API-Key": key})
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
            cpu_ms = (tree_cpu_s(srv.proc.pid) - before) * 1e3 / requests
            rows.append({"case": case, "body": BODY, "status": codes, "cpu_ms": round(cpu_ms, 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--precision", default="int8", choices=["fp32", "int8"])
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    problem = None
    if not (args.model / "config.json").is_file():
        problem = f"no checkpoint in {args.model}"
    elif not args.out.parent.is_dir():
        problem = f"--out: folder {args.out.parent} does not exist"
    elif args.requests < 1:
        problem = "--requests must be positive"
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    rows = measure(args.model, args.precision, args.requests)
    args.out.write_text(json.dumps({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(),
                                    "precision": args.precision, "workers": 1, "requests": args.requests,
                                    "rows": rows, "command": f"python -m headbudget.loadtest.{PROG} " + " ".join(
                                        sys.argv[1:] if argv is None else argv)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
