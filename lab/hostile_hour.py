"""An hour of hostile traffic against a checkpoint, one worker and two behind haproxy; writes hostile-hour.json.

    python -m lab.hostile_hour --model checkpoints/ag_news-quick --out docs/results/ag_news/model-quick/hostile-hour.json

For each setup (one `headbudget serve`; two behind haproxy, both on one Redis): schemathesis over every route with
a key of each tier (`lab.hostile.schema`), then the soak (`lab.hostile.soak`, 30 minutes by default). Once, in
process: the request parser fuzzed against FastAPI's validation (`lab.hostile.fuzz`). Loopback only, bounded:
each stage has its time. Resumable: each finished stage is kept in ``--work``/stages.json and not run again.
Exit status 0 when nothing failed: no 5xx but load shedding, no schema violation, no fuzz finding, usage equal
to the answered charges, memory within 5%, the light key's p99 at the end within 10% of the start.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser
from headbudget.loadtest.fairness import to_toml
from headbudget.loadtest.faults import Redis
from lab.hostile import fuzz, soak
from lab.hostile.schema import run_schemathesis

ROOT = Path(__file__).resolve().parents[1]


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{model} ({', '.join(isa)})"


def schema_stage(model: Path, folder: Path, replicas: int, examples: int) -> dict[str, Any]:
    """schemathesis against the setup's servers, configured as the soak's (its keys, its tiers)."""
    folder.mkdir(parents=True, exist_ok=True)
    redis = Redis(folder)
    keys = soak.Keys()
    config = folder / "service.toml"
    redis.start()
    config.write_text(to_toml(soak.config_doc(keys, redis.url, folder / "journal", 10_000.0)))
    servers = soak.Servers(model, config, folder, replicas, "int8")
    try:
        tier_max = {t: c["max_budget"] for t, c in soak.TIERS.items()}
        tier_max["metered"] = tier_max["balanced"]
        report = run_schemathesis(servers.url, {"cheap": keys.light, "balanced": keys.balanced,
                                                "quality": keys.quality}, tier_max, folder, max_examples=examples)
    finally:
        servers.stop()
        redis.stop()
    return report.as_json()


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lab.hostile_hour", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="hostile-hour.json")
    p.add_argument("--work", type=Path, default=Path("runs/hostile-hour"), help="logs, reports and stages.json")
    p.add_argument("--soak-s", type=float, default=1800, help="each soak's length")
    p.add_argument("--fuzz-s", type=int, default=600, help="the fuzzer's time")
    p.add_argument("--examples", type=int, default=150, help="schemathesis's cases per route and tier")
    p.add_argument("--workers", default="1,2", help="the setups: 1 worker, 2 behind haproxy")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: not a checkpoint folder")
    args.work.mkdir(parents=True, exist_ok=True)
    state_path = args.work / "stages.json"
    stages: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}

    def stage(name: str, fn: Any) -> Any:
        if name not in stages:
            print(f"{datetime.datetime.now():%H:%M:%S} {name}", flush=True)
            stages[name] = fn()
            state_path.write_text(json.dumps(stages, indent=2) + "\n")
        return stages[name]

    result = stage("fuzz", lambda: fuzz.fuzz(args.model, args.work / "fuzz", seconds=args.fuzz_s))
    setups = []
    for n in (int(w) for w in args.workers.split(",")):
        schema = stage(f"schemathesis-{n}", lambda n=n: schema_stage(args.model, args.work / f"schema-{n}", n,
                                                                     args.examples))
        soaked = stage(f"soak-{n}", lambda n=n: soak.run(args.model, args.work / f"soak-{n}", replicas=n,
                                                         seconds=args.soak_s))
        setups.append({"cpu": cpu(), "date": datetime.date.today().isoformat(),
                       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                capture_output=True, text=True).stdout.strip(),
                       "model": str(args.model), "workers": n,
                       "command": "python -m lab.hostile_hour " + " ".join(argv or sys.argv[1:]),
                       "schemathesis": {k: v for k, v in schema.items() if k != "failures"},
                       "schemathesis_failures": schema["failures"], "fuzz": result, "soak": soaked})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(setups, indent=2) + "\n")
    ok = all(s["schemathesis"]["server_errors"] == s["schemathesis"]["schema_violations"] == 0
             and s["schemathesis"]["impossible_answers"] == 0 and s["soak"]["server_errors"] == 0
             and s["soak"]["usage_minus_answers_units"] == 0 and s["soak"]["rss_growth_pct"] <= 5
             and (s["soak"]["light_p99_last_ms"] or 0) <= 1.1 * (s["soak"]["light_p99_first_ms"] or 0)
             for s in setups) and not (result["crashes"] or result["mismatches"])
    print(json.dumps(setups, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
