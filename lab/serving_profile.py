"""Where a served request's CPU goes on the event loop: `python -m lab.serving_profile --model CKPT --data DIR --out F`.

`headbudget serve --workers 1`'s app under uvicorn (as serve runs it) in this process, pinned to ``--server-cpu``,
with a key of a metered tier that never binds (``loadtest.serving_limit``'s); a client process on
``--client-cpu`` runs ``loadtest.concurrency``'s closed loop over plain sockets at ``--conc`` connections, one AG
News text a request at ``--budget``. Two windows of ``--seconds``: the first unprofiled (the loop thread's CPU, the
engine's counter and the process's CPU per answer), the second with cProfile on the loop thread only, timed by
the thread's own CPU clock. Each step's share of the profiled loop time (its functions' cumulative time; HTTP and
asyncio by their own time) is put onto the unprofiled loop CPU per answer: cProfile slows Python more than C, so
the shares are approximate.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import uvicorn
import uvloop

from headbudget.commands.parser import OneLineParser
from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest.concurrency import CLIENTS, headbudget_target, load_texts
from headbudget.loadtest.service_bench import free_port
from headbudget.loadtest.serving_limit import KEY, server_config
from headbudget.service.app import create_app, default_engine_factory
from headbudget.service.logs import configure_logging
from headbudget.service.settings import ServeSettings, parse_config
from lab.script_output import check_out, write_doc

PROG = "python -m lab.serving_profile"

# step -> (module path fragment, function name): cumulative time of each (they do not nest in one another)
STEPS: dict[str, list[tuple[str, str]]] = {
    "parse body and query": [("service/http/fastpath.py", "_parse"), ("service/http/fastpath.py", "_is_json")],
    "identify the key": [("service/http/deps.py", "identify_caller")],
    "floor price and cap": [("service/accounting/compute.py", "floor_quote"), ("service/accounting/compute.py", "check_cap")],
    "admission (rate, quota)": [("service/accounting/auth.py", "admit")],
    "exact price (tokenizing)": [("service/accounting/compute.py", "quote")],
    "queue (submit)": [("service/scheduling/batching.py", "submit")],
    "answers delivered (futures)": [("service/scheduling/batching.py", "_set")],
    "bill and settle": [("service/accounting/compute.py", "bill"), ("service/pipeline.py", "_settle")],
    "metrics": [("service/metrics.py", "observe_answer"), ("service/metrics.py", "flush_answers"),
                ("service/metrics.py", "observe_request")],
    "usage books": [("service/pipeline.py", "_record_usage")],
    "feedback store": [("service/pipeline.py", "_remember")],
    "answer body and JSON": [("service/pipeline.py", "classify_body"), ("~", "<method 'to_json'"),
                             ("~", "<built-in method pydantic_core._pydantic_core.to_json>")],
    "access record": [("service/logs.py", "log_access")],
}
OWN_TIME = {"HTTP (uvicorn, httptools)": ("uvicorn/", "httptools"), "asyncio": ("asyncio/", "uvloop", "selectors")}


def breakdown(stats: pstats.Stats, loop_ms: float) -> dict[str, float]:
    """ms per answer of each step, from the profile's shares of the loop thread's time."""
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in table.values())  # every function's own time
    out: dict[str, float] = {}
    for step, fns in STEPS.items():
        cum = sum(v[3] for (path, _, name), v in table.items()
                  for frag, fn in fns if (frag in path or frag == path) and (name == fn or name.startswith(fn)))
        out[step] = cum
    for step, frags in OWN_TIME.items():
        out[step] = sum(v[2] for (path, _, name), v in table.items() if any(f in path or f in name for f in frags))
    out["other (middleware, fast path, starlette, the pipeline's own lines)"] = max(0.0, total - sum(out.values()))
    return {k: round(v / total * loop_ms, 4) for k, v in out.items()}


def drive(url: str, budget: float, conc: int, seconds: float, data: Path) -> None:
    """The client process: one closed loop, its answer count on stdout."""
    target = headbudget_target(url, os.getppid(), budget, KEY)
    answered, _, failed = CLIENTS["wire"](target, load_texts(data, 2000), conc, seconds)
    print(json.dumps({"answered": answered, "failed": failed}), flush=True)


async def serve_and_measure(app: Any, port: int, args: Any) -> dict[str, Any]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                                           lifespan="on", log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.1)
    runtime = app.state.runtime
    counter = runtime.metrics.engine_cpu_seconds

    def engine_s() -> float:
        return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))

    async def window(seconds: float, profile: cProfile.Profile | None) -> dict[str, Any]:
        client = await asyncio.create_subprocess_exec(
            "taskset", "-c", args.client_cpu, sys.executable, "-m", "lab.serving_profile", "--drive",
            f"http://127.0.0.1:{port}", "--budget", str(args.budget), "--conc", str(args.conc), "--seconds",
            str(seconds + 2), "--data", str(args.data), stdout=asyncio.subprocess.PIPE)
        await asyncio.sleep(2)  # the client's warm-up
        t0, p0, e0 = time.thread_time(), time.process_time(), engine_s()
        if profile is not None:
            profile.enable()
        await asyncio.sleep(seconds)
        if profile is not None:
            profile.disable()
        loop_s, process_s, engine = time.thread_time() - t0, time.process_time() - p0, engine_s() - e0
        out, _ = await client.communicate()
        answered = json.loads(out.decode().strip().splitlines()[-1])["answered"] * seconds / (seconds + 2)
        n = max(1.0, answered)
        return {"answers": round(answered), "loop_ms": loop_s * 1e3 / n, "process_ms": process_s * 1e3 / n,
                "engine_ms": engine * 1e3 / n}

    plain = await window(args.seconds, None)
    # this thread's CPU clock, not the wall's: a call that releases the GIL (the tokenizer) is not charged for
    # the engine thread's forward pass that takes the core meanwhile
    profile = cProfile.Profile(time.thread_time)
    profiled = await window(args.seconds, profile)
    server.should_exit = True
    await task
    stats = pstats.Stats(profile)
    return {"unprofiled": {k: round(v, 4) for k, v in plain.items()},
            "profiled": {k: round(v, 4) for k, v in profiled.items()},
            "loop_ms_per_answer_by_step": breakdown(stats, plain["loop_ms"]),
            "engine_thread_ms_per_answer": round(plain["process_ms"] - plain["loop_ms"], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--conc", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--server-cpu", default="1")
    ap.add_argument("--client-cpu", default="0")
    ap.add_argument("--drive", help=argparse.SUPPRESS)  # the client process's own mode
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.drive:
        drive(args.drive, args.budget, args.conc, args.seconds, args.data)
        return 0
    try:
        if args.model is None or args.out is None:
            raise ValueError("--model and --out are required")
        check_out(args.out)
        if not (args.data / "test.csv").is_file():
            raise ValueError(f"no test.csv in {args.data}")
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {int(c) for c in args.server_cpu.split(",")})
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `headbudget serve` runs
    configure_logging("WARNING")
    config_path = Path(tempfile.mkdtemp(prefix="serving-profile-")) / "service.toml"
    config_path.write_text(server_config(args.budget))
    config = parse_config(tomllib.loads(config_path.read_text()))
    settings = ServeSettings(model_dir=args.model, config_path=config_path, precision="int8")
    app = create_app(config, default_engine_factory(settings, config.default_budgets()))
    # uvloop, as `uvicorn.Server.run` picks it for `headbudget serve`
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(serve_and_measure(app, free_port(), args))
    print(json.dumps(result, indent=1))
    write_doc({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(), "budget": args.budget,
               "conc": args.conc, "seconds": args.seconds, **result}, args.out, "serving_profile", argv)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "loop"
    sys.exit(main())
