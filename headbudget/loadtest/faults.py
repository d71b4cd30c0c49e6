"""Books under faults: `python -m headbudget.loadtest.faults --model DIR --out FILE`.

A real server (one worker, 127.0.0.1) on a real redis-server with an append-only file, one key of a tier with room
to spare, closed-loop clients sending short texts; in each case a fault strikes mid-load:
- ``redis_stall``: Redis answers nobody for 0.6 s, three times (DEBUG SLEEP), past the server's 0.25 s timeout;
- ``redis_down_open``: Redis stopped for a few seconds and started again, the server failing open;
- ``redis_down_closed``: the same, failing closed (refused while Redis is away; what was in flight is answered);
- ``server_killed_with_journal``: Redis stopped, the server answers into its journal and is SIGKILLed; Redis comes
  back and a new server on the same journal folder starts.
Each case ends when the journal is empty; it writes what the clients were answered (``answered_units``: the sum of
the charges of the 200 answers), what the store holds (``usage_units``: the key's usage today, from /v1/usage),
``diff_units`` and ``journal_replayed`` (lines in the journal before Redis came back). Exit status: 0 when every
case's usage equals its answers to the milli-unit, 1 otherwise, 2 when the run could not be made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from headbudget.commands.parser import OneLineParser
from headbudget.engine.names import PRECISION_NAMES
from headbudget.loadtest.fairness import server_config, to_toml
from headbudget.loadtest.service_bench import free_port
from headbudget.service.accounting.auth import new_key
from headbudget.service.accounting.journal import UsageJournal

PROG = "faults"
TEXTS = ("stocks rally as tech earnings beat forecasts", "the striker scored twice before halftime",
         "scientists said the probe sent back images of the planet rings and a storm larger than earth",
         "oil prices fell as investors weighed new data on jobs growth")
CASES = ("redis_stall", "redis_down_open", "redis_down_closed", "server_killed_with_journal")


class Redis:
    """A redis-server on a fixed loopback port, with an append-only file synced on every write, restartable."""

    def __init__(self, folder: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian package redis-server)")
        self.exe, self.folder, self.port = exe, folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.folder), "--enable-debug-command", "local"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: self._call("PING").startswith(b"+PONG"), 20, "redis-server")

    def stall(self, seconds: float) -> None:
        self._call(f"DEBUG SLEEP {seconds}", timeout=seconds + 10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(20)
            self.proc = None

    def _call(self, command: str, timeout: float = 1.0) -> bytes:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
                s.sendall(command.encode() + b"\r\n")
                return s.recv(64)
        except OSError:
            return b""


class Serve:
    """`headbudget serve` (one worker) on a fixed port with a config file, until stopped or killed."""

    def __init__(self, model: Path, config: Path, port: int, log: Path, precision: str) -> None:
        cmd = [sys.executable, "-m", "headbudget.cli", "serve", "--model", str(model), "--config", str(config),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--precision", precision]
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        wait_until(lambda: self._ready(), 180, "the server")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError("the server exited at start")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        self.proc.wait(60)


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready in {timeout_s:g} s")
        time.sleep(0.1)


@dataclass
class Answers:
    """What the clients were answered: charges of the 200s in milli-units, and the other statuses."""

    charges: list[int] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)


async def clients(url: str, key: str, users: int, stop: asyncio.Event, out: Answers) -> None:
    """``users`` closed loops of one short text a request until ``stop``."""
    async def loop(i: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers={"X-API-Key": key}) as c:
            n = i
            while not stop.is_set():
                n += users
                try:
                    r = await c.post("/classify", json={"text": TEXTS[n % len(TEXTS)]})
                except httpx.HTTPError as e:
                    out.codes[type(e).__name__] = out.codes.get(type(e).__name__, 0) + 1
                    await asyncio.sleep(0.05)
                    continue
                out.codes[str(r.status_code)] = out.codes.get(str(r.status_code), 0) + 1
                if r.status_code == 200:
                    out.charges.append(round(r.json()["charge"] * 1000))
                else:
                    await asyncio.sleep(0.05)
    await asyncio.gather(*(loop(i) for i in range(users)))


@dataclass
class Setup:
    model: Path
    base: dict[str, Any]
    tier: str
    folder: Path
    precision: str
    users: int
    down_s: float


def _config(setup: Setup, key: str, redis_url: str, on_error: str, journal: Path) -> Path:
    text = server_config(setup.base, setup.tier, {"faults": key}, redis_url)
    doc = tomllib.loads(text)
    doc["state"].update(on_error=on_error, journal_dir=str(journal))
    path = setup.folder / f"service-{on_error}.toml"
    path.write_text(to_toml(doc))
    return path


def _usage_units(url: str, key: str, timeout_s: float = 60) -> int:
    """The key's usage today. The key's request rate counts this request too, and the load just before may have
    spent it: a 429 is waited out as its Retry-After says, as a client should."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/v1/usage", headers={"X-API-Key": key}, timeout=30)
        if r.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(min(float(r.headers.get("retry-after", "1")), 5.0))
    r.raise_for_status()
    return round(float(r.json()["today"]["units"]) * 1000)


def run_case(setup: Setup, case: str) -> dict[str, Any]:
    """One fault under load on a fresh Redis, server and key; the row of faults.json."""
    folder = Path(tempfile.mkdtemp(prefix=f"{case}-", dir=setup.folder))
    redis, journal, key = Redis(folder), UsageJournal(folder / "journal", 1 << 30), new_key()
    config = _config(setup, key, redis.url, "closed" if case == "redis_down_closed" else "open", journal.folder)
    port, log = free_port(), folder / "server.log"
    redis.start()
    servers = [Serve(setup.model, config, port, log, setup.precision)]
    answers = Answers()
    try:
        waiting = asyncio.run(_under_load(case, setup, redis, servers[0], journal, key, answers))
        if case == "server_killed_with_journal":
            servers.append(Serve(setup.model, config, port, log, setup.precision))
        wait_until(lambda: journal.pending() == 0, 60, "the journal's replay")
        usage = _usage_units(servers[-1].url, key)
    finally:
        for s in servers:
            s.kill(signal.SIGTERM)
        redis.stop()
    answered = sum(answers.charges)
    return {"case": case, "answered": len(answers.charges), "answered_units": answered / 1000,
            "usage_units": usage / 1000, "diff_units": (usage - answered) / 1000, "journal_replayed": waiting,
            "status_counts": answers.codes}


async def _under_load(case: str, setup: Setup, redis: Redis, server: Serve, journal: UsageJournal, key: str,
                      answers: Answers) -> int:
    """Strike the case's fault while the clients run; the journal lines waiting when Redis came back. The killed
    server is killed with no request in flight (one in flight would be computed, billed and never delivered)."""
    stop = asyncio.Event()
    load = asyncio.create_task(clients(server.url, key, setup.users, stop, answers))
    await asyncio.sleep(1.0)
    if case == "redis_stall":
        for _ in range(3):
            await asyncio.to_thread(redis.stall, 0.6)
            await asyncio.sleep(0.5)
    else:
        await asyncio.to_thread(redis.stop)
        await asyncio.sleep(setup.down_s)
        if case == "server_killed_with_journal":
            stop.set()
            await load
            await asyncio.to_thread(server.kill)
    waiting = journal.pending()
    if case != "redis_stall":
        await asyncio.to_thread(redis.start)
        await asyncio.sleep(1.0)
    stop.set()
    await load
    return waiting


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("checkpoints/ag_news-quick"), help="checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--config", type=Path, default=Path("service.toml"), help="tiers and server settings to serve")
    p.add_argument("--tier", default="balanced", help="the key's tier (refusals by its rate and quota are counted, not billed)")
    p.add_argument("--users", type=int, default=4, help="concurrent clients")
    p.add_argument("--down-seconds", type=float, default=5.0, help="how long Redis stays away")
    p.add_argument("--case", choices=CASES, action="append", help="run only these cases (default: all)")
    p.add_argument("--precision", choices=PRECISION_NAMES, default="int8")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"{PROG}: {args.model} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    try:
        base = tomllib.loads(args.config.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        print(f"{PROG}: {args.config}: {e}", file=sys.stderr)
        return 2
    if args.tier not in base.get("tiers", {}):
        print(f"{PROG}: {args.config} has no tier {args.tier!r}", file=sys.stderr)
        return 2
    from headbudget.experiments.bench import code_commit, cpu_name

    with tempfile.TemporaryDirectory(prefix="headbudget-faults-") as tmp:
        setup = Setup(args.model, base, args.tier, Path(tmp), args.precision, args.users, args.down_seconds)
        try:
            rows = [run_case(setup, case) for case in (args.case or CASES)]
        except RuntimeError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 2
    doc = {"cases": rows, "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"),
           "commit": code_commit(short=False), "command": " ".join(["python -m headbudget.loadtest.faults",
                                                                   *(argv if argv is not None else sys.argv[1:])]),
           "checkpoint": str(args.model), "tier": args.tier, "users": args.users, "precision": args.precision}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    for r in rows:
        print(f"{r['case']}: answered {r['answered']} ({r['answered_units']} units), usage {r['usage_units']}, "
              f"diff {r['diff_units']}, journal {r['journal_replayed']}")
    return 0 if all(r["diff_units"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
