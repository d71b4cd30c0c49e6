"""The first hour of a new user, timed: a fresh clone's `make test`, then its `make run` until the printed curl
command gets an answer.

    python -m lab.first_hour --out docs/results/ag_news-quick/first-hour.json

Clones this repository's HEAD beside it (``../shared`` must be there, as CI has it), runs both commands as a user
would and writes ``first-hour.json``: the CPU and its instruction sets, `make test`'s wall time, its pytest part,
its counts and its slowest tests, `make run`'s time to the first answer and its phases (each phase ends where the
next command of `make run` starts). Nothing here imports headbudget's code under test: it times the commands from
outside. On a CPU with AMX, `python -m lab.without_amx -- python -m lab.first_hour ...` times them as an AVX-512
VNNI CPU without AMX runs them (``amx_refused``); on one with AVX-512, `python -m lab.avx2_only -- ...` as an AVX2
CPU runs them (``avx2_only``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser
from lab.avx2_only import vendor_in_effect
from lab.without_amx import request_amx

ROOT = Path(__file__).resolve().parents[1]
ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")
# The lines of `make run`'s output that end one phase and start the next, in order.
PHASES = (("install", re.compile(r"^\S*pip install|python3 -m venv ")),
          ("train", re.compile(r"headbudget train ")),
          ("decider", re.compile(r"headbudget decider ")),
          ("serve_start", re.compile(r"headbudget serve ")),
          ("ready", re.compile(r"headbudget is ready")))


@dataclass(frozen=True)
class Cpu:
    model: str
    isa: list[str]  # the instruction sets the commands may use
    amx_refused: bool  # a CPU with AMX run under `lab.without_amx`: its amx flags are left out
    avx2_only: bool  # a CPU with AVX-512 run under `lab.avx2_only`: only avx2 is left
    vendor: str | None = None  # under `lab.avx2_only`: the vendor CPUID names ("own" or "amd")

    @property
    def wrapper(self) -> str:
        if self.avx2_only:
            return f"python -m lab.avx2_only --vendor {self.vendor} -- "
        return "python -m lab.without_amx -- " if self.amx_refused else ""


def cpu() -> Cpu:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    isa = [f for f in ISA if f in flags]
    from numpy._core._multiarray_umath import __cpu_features__  # what CPUID tells this process

    avx2_only = "avx512f" in isa and not __cpu_features__.get("AVX512F", False)
    refused = any(f.startswith("amx") for f in isa) and request_amx() == errno.EPERM
    if avx2_only:
        isa = [f for f in isa if f == "avx2"]
    elif refused:
        isa = [f for f in isa if not f.startswith("amx")]
    return Cpu(model, isa, refused, avx2_only, vendor_in_effect() if avx2_only else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_test(clone: Path, log: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(["make", "test"], cwd=clone, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t0
    text = log.read_text()
    summary = re.findall(r"(?:(\d+) failed, )?(\d+) passed(?:, (\d+) skipped)?.* in ([\d.]+)s", text)
    failed, passed, skipped, pytest_s = summary[-1] if summary else ("", "0", "", "0")
    return {"make_test_s": round(wall, 1), "pytest_s": float(pytest_s), "exit_code": rc, "passed": int(passed),
            "failed": int(failed or 0), "skipped": int(skipped or 0), "slowest_s": slowest(text)}


_DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown) +(\S.*?)\s*$")


def slowest(text: str) -> dict[str, float]:
    """pytest's ``--durations`` lines of a log, "phase test" -> seconds: where a CPU's time goes."""
    return {f"{m[2]} {m[3]}": float(m[1]) for m in map(_DURATION.match, text.splitlines()) if m}


def make_run(clone: Path, log: Path, timeout_s: float) -> dict[str, Any]:
    """Start `make run`, note when each phase's line appears, run the printed curl until it answers 200."""
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen(["make", "run", f"PORT={port}"], cwd=clone, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: dict[str, float] = {}
    curl: list[str] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            for name, pattern in PHASES:
                if name not in seen and pattern.search(line):
                    seen[name] = time.monotonic() - t0
            if line.strip().startswith("curl "):
                curl.append(line.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    answered, answer, shown = None, "", []
    try:
        while time.monotonic() - t0 < timeout_s and proc.poll() is None and answered is None:
            if curl:
                r = subprocess.run(shlex.split(curl[0]) + ["-w", "\n%{http_code}"], capture_output=True, text=True)
                body, _, code = r.stdout.rpartition("\n")
                if code == "200":
                    answered, answer, shown = time.monotonic() - t0, body, list(lines)
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(5)
        log.write_text("".join(lines))
    order = [name for name, _ in PHASES if name in seen]
    phases = {name: round((seen[nxt] if nxt else answered or 0) - seen[name], 1)
              for name, nxt in zip(order, [*order[1:], None], strict=True) if name != "ready"}
    return {"make_run_first_answer_s": None if answered is None else round(answered, 1), "phases_s": phases,
            "first_answer": json.loads(answer) if answer else None,
            # What the terminal showed below the curl command by the first answer (the access log goes to a file).
            "printed_after_curl": _after(shown, curl[0]) if curl else None}


def _after(lines: list[str], curl: str) -> list[str]:
    at = max(i for i, ln in enumerate(lines) if ln.strip() == curl)
    notes = ("Requests are logged", "budget=auto is being calibrated")  # the server's own note below the command
    return [ln.rstrip() for ln in lines[at + 1:] if ln.strip() and not ln.strip().startswith(notes)]


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lab.first_hour", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where to write first-hour.json")
    p.add_argument("--clone", type=Path, default=ROOT.parent / "first-hour",
                   help="the fresh clone (removed first; its parent must hold shared/)")
    p.add_argument("--run-timeout", type=float, default=1800)
    args = p.parse_args(argv)
    if not (args.clone.parent / "shared").is_dir():
        print(f"first_hour: error: {args.clone.parent / 'shared'} is missing (the data the commands read)",
              file=sys.stderr)
        return 2
    shutil.rmtree(args.clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(args.clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.clone, capture_output=True, text=True).stdout
    machine = cpu()
    logs = args.out.parent
    logs.mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    doc: dict[str, Any] = {"cpu": machine.model, "isa": machine.isa, "amx_refused": machine.amx_refused,
                           "avx2_only": machine.avx2_only, "vendor_as": machine.vendor, "cores": os.cpu_count(),
                           "commit": commit.strip(), "date": time.strftime("%Y-%m-%d"),
                           "command": f"{machine.wrapper}python -m lab.first_hour {command}"}
    doc |= make_test(args.clone, Path("/tmp/first-hour-make-test.log"))
    doc |= make_run(args.clone, Path("/tmp/first-hour-make-run.log"), args.run_timeout)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "first_answer"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
