"""How close the server comes to its engine's limit, and to a dense peer: `python -m headbudget.loadtest.serving_limit`.

One run, one file (``serving-limit.json``):
1. The engine alone: ``headbudget bench`` at AG News lengths, batch 1, on the server's core; 1 / its forward pass
   is the most answers a core can give at each budget.
2. `headbudget serve --workers 1` on that core (int8, a metered tier whose quota never binds, one API key) and,
   with ``--peer-python``, Infinity serving this checkpoint's ``headbudget export --precision int8`` folder
   unchanged (one ONNX Runtime thread, ``lab/infinity_peer``), both started here and stopped here.
3. From the other core, ``loadtest.concurrency``'s closed loop over plain sockets at each concurrency, headbudget at
   each budget and the peer, rotated run by run: requests per second, latency, server CPU per answer and the
   engine's share of it.
``--before TREE`` adds a second headbudget server run from another checkout of the code (its rows' ``server`` is
``headbudget-before``), measured in the same rotation: a change's effect as a ratio taken side by side, not across
runs minutes apart. ``checks`` puts the rows beside the engine-alone limit and the peer (medians over runs).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from headbudget.commands.common import budget_arg
from headbudget.commands.parser import OneLineParser
from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest.concurrency import (
    CLIENTS,
    Target,
    headbudget_target,
    load_texts,
    peer_target,
    plan,
    step,
)
from headbudget.loadtest.service_bench import CONFIG, Server, free_port, pinned, stop_group, wait_ready
from headbudget.service.accounting.auth import hash_key

PROG = "python -m headbudget.loadtest.serving_limit"
KEY = "hb_limit_key_000000000000000000000000000"
# A metered tier (priced, admitted, billed) whose limits never bind under the load: every answer does the
# accounting a shipped tier does.
TIER = ("compute_per_minute = 100000000\ncompute_burst = 100000000\nmax_request_compute = 1000000\n"
        f'[[keys]]\nsha256 = "{hash_key(KEY)}"\ntier = "bench"\nname = "limit"\n')
PEER_DIR = Path(__file__).resolve().parents[2] / "lab" / "infinity_peer"


def server_config(budget: float) -> str:
    return CONFIG.format(batch=32, wait=3.0, budget=budget).replace('anonymous_tier = "bench"\n', "") + TIER


@contextmanager
def code_from(tree: Path | None) -> Iterator[None]:
    """Processes started in the block import headbudget from ``tree`` (None: this checkout)."""
    if tree is None:
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree.resolve())
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def engine_alone(model: Path, data: Path, cpu: str, repeats: int, work: Path) -> list[dict[str, Any]]:
    """``headbudget bench``'s batch-1 latency per budget at AG News lengths, on ``cpu``."""
    out = work / "bench.json"
    cmd = ["taskset", "-c", cpu, sys.executable, "-m", "headbudget.cli", "bench", "--model", str(model), "--data",
           str(data), "--batch-size", "1", "--precision", "int8", "--repeats", str(repeats), "--no-memory",
           "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    return [{"budget": r["budget"], "ms": r["latency_ms"], "answers_per_core_s": round(1000 / r["latency_ms"], 1)}
            for r in rows]


class Peer:
    """Infinity serving ``folder`` on a free port, pinned to ``cpu``, one ONNX Runtime thread; stopped on exit."""

    def __init__(self, python: Path, folder: Path, cpu: str, log: Path) -> None:
        self.port = free_port()
        self.python = python
        cli = python.parent / "infinity_emb"
        env = {**os.environ, "PYTHONPATH": str(PEER_DIR), "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
               "OMP_NUM_THREADS": "1"}
        self.log = open(log, "w+b")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            # run in the folder as model "." (optimum looks a path model-id's file up as a path inside it)
            ["taskset", "-c", cpu, str(cli), "v2", "--model-id", ".", "--engine", "optimum", "--device",
             "cpu", "--port", str(self.port), "--host", "127.0.0.1",
             # its warm-up sends one text past 512 tokens, which the untruncating pipeline hands to the model; the
             # closed loop warms it up before each measured step
             "--no-model-warmup"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=folder, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def version(self) -> str:
        out = subprocess.run([str(self.python), "-c",
                              "import importlib.metadata as m; print(m.version('infinity-emb'))"],
                             capture_output=True, text=True, check=False)
        return out.stdout.strip()

    def __enter__(self) -> Peer:
        wait_ready(self.proc, self.log, f"{self.url}/health", 300, "peer")
        return self

    def __exit__(self, *exc: object) -> None:
        stop_group(self.proc, 30)
        self.log.close()


def checks(engine: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server, budget and concurrency (medians over runs): requests per second as a share of the engine-alone
    limit, CPU per answer less the forward pass (ms, and as a share of b = 1's pass), CPU per answer over b = 1's,
    requests per second over each peer's, and this code's requests per second and CPU over the earlier code's."""
    alone = {e["budget"]: e for e in engine}

    def med(server: str, budget: float | None, conc: int, key: str) -> float | None:
        vals = [r[key] for r in rows if r["server"] == server and r["budget"] == budget and r["conc"] == conc
                and r[key] is not None]
        return statistics.median(vals) if vals else None

    out = []
    peers = sorted({r["server"] for r in rows if r["budget"] is None})
    ours = sorted({(r["server"], r["budget"], r["conc"]) for r in rows if r["budget"] is not None},
                  key=lambda x: (x[0], -x[1], x[2]))
    for server, budget, conc in ours:
        rps, cpu = med(server, budget, conc, "rps"), med(server, budget, conc, "cpu_ms_per_answer")
        cpu1 = med(server, 1.0, conc, "cpu_ms_per_answer")
        row: dict[str, Any] = {"server": server, "budget": budget, "conc": conc, "rps": rps, "cpu_ms_per_answer": cpu}
        if budget in alone and rps is not None and cpu is not None:
            row["share_of_engine_limit"] = round(rps / alone[budget]["answers_per_core_s"], 3)
            row["rest_ms"] = round(cpu - alone[budget]["ms"], 3)
            if 1.0 in alone:
                row["rest_over_b1_pass"] = round((cpu - alone[budget]["ms"]) / alone[1.0]["ms"], 3)
        if cpu1 and cpu is not None:
            row["cpu_over_b1"] = round(cpu / cpu1, 3)
        for peer in peers:
            peer_rps = med(peer, None, conc, "rps")
            if peer_rps and rps is not None:
                row[f"over_{peer}"] = round(rps / peer_rps, 2)
        before_rps = med("headbudget-before", budget, conc, "rps")
        before_cpu = med("headbudget-before", budget, conc, "cpu_ms_per_answer")
        if server == "headbudget" and before_rps and before_cpu and rps is not None and cpu is not None:
            row["rps_over_before"] = round(rps / before_rps, 3)
            row["cpu_over_before"] = round(cpu / before_cpu, 3)
        out.append(row)
    return out


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    p.add_argument("--data", type=Path, required=True, help="a folder with test.csv (AG News)")
    p.add_argument("--budgets", type=budget_arg, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    p.add_argument("--conc", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200, help="headbudget bench's repeats")
    p.add_argument("--server-cpu", default="1", help="the core of the server, the peer and the engine-alone bench")
    p.add_argument("--client-cpu", default="0", help="the load generator's core")
    p.add_argument("--peer-python", type=Path, help="python of an environment with infinity-emb (none: no peer)")
    p.add_argument("--before", type=Path, metavar="TREE",
                   help="a checkout of earlier code: its server is measured beside this one's (headbudget-before)")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = None
    if not (args.model / "config.json").is_file():
        problem = f"no checkpoint in {args.model}"
    elif not (args.data / "test.csv").is_file():
        problem = f"no test.csv in {args.data}"
    elif not args.out.parent.is_dir():
        problem = f"--out: folder {args.out.parent} does not exist"
    elif args.peer_python is not None and not (args.peer_python.parent / "infinity_emb").is_file():
        problem = f"--peer-python: no infinity_emb beside {args.peer_python}"
    elif args.before is not None and not (args.before / "headbudget" / "cli.py").is_file():
        problem = f"--before: no headbudget checkout in {args.before}"
    elif shutil.which("taskset") is None:
        problem = "taskset not found (util-linux)"
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    texts = load_texts(args.data, 2000)
    work = Path(tempfile.mkdtemp(prefix="serving-limit-"))
    try:
        engine = engine_alone(args.model, args.data, args.server_cpu, args.repeats, work)
        print(json.dumps({"engine_alone": engine}), flush=True)
        peers: list[dict[str, Any]] = []
        with ExitStack() as stack:
            srv = stack.enter_context(Server(args.model, 1, config_text=server_config(args.budgets[0]),
                                             precision="int8", cpus=args.server_cpu))
            targets: list[Target] = [headbudget_target(srv.url, srv.proc.pid, b, KEY) for b in args.budgets]
            if args.before is not None:
                with code_from(args.before):
                    old = Server(args.model, 1, config_text=server_config(args.budgets[0]), precision="int8",
                                 cpus=args.server_cpu)
                stack.enter_context(old)
                targets += [replace(headbudget_target(old.url, old.proc.pid, b, KEY), server="headbudget-before")
                            for b in args.budgets]
            if args.peer_python is not None:
                folder = work / "export-int8"
                subprocess.run([sys.executable, "-m", "headbudget.cli", "export", "--model", str(args.model),
                                "--precision", "int8", "--out", str(folder)], check=True, stdout=subprocess.DEVNULL)
                peer = stack.enter_context(Peer(args.peer_python, folder, args.server_cpu, work / "peer.log"))
                name = "infinity-emb"
                targets.append(replace(peer_target(peer.url, peer.proc.pid, "."), server=name))
                peers.append({"name": name, "version": peer.version(), "model": f"headbudget export --precision int8 "
                              f"of {args.model.name}", "ort_threads": 1})
            rows = []
            with pinned({int(c) for c in args.client_cpu.split(",")}):
                for target, conc, run in plan(targets, args.conc, args.runs):
                    rows.append(step(target, texts, conc, args.seconds, run, CLIENTS["wire"]))
                    print(json.dumps(rows[-1]), flush=True)
    except (subprocess.CalledProcessError, RuntimeError, OSError, httpx.HTTPError) as e:
        print(f"{PROG}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(), "workers": 1,
           "checkpoint": args.model.name, "seconds": args.seconds, "client": "wire", "texts": len(texts),
           "engine_alone": engine, "rows": rows, "peers": peers, "checks": checks(engine, rows),
           "before": None if args.before is None else {"tree": str(args.before), "commit": subprocess.run(
               ["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
               check=False).stdout.strip()},
           "command": f"{PROG} " + " ".join(sys.argv[1:] if argv is None else argv)}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
