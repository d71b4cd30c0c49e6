"""What every ``python -m lab.X`` script shares: the latency options (measure_latency's protocol), the JSON
document it writes, with the command that made it, and the exec of the wrappers that run a command as another CPU."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def check_out(out: Path) -> None:
    """Refuse an output path that cannot be written before any work is done (not after minutes of it)."""
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder, not a file")


def write_doc(doc: dict[str, Any], out: Path, module: str, argv: list[str] | None) -> None:
    """Record the exact command in ``doc`` (so results.md can quote it) and write it to ``out``."""
    doc["command"] = f"python -m lab.{module} " + " ".join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps(doc, indent=1) + "\n")


def add_latency_options(p: argparse.ArgumentParser, repeats: int = 5) -> None:
    """measure_latency's protocol (headbudget/experiments/compare/measure.py) as a script's options."""
    p.add_argument("--latency-texts", type=int, default=150, help="test texts timed per entry, batch 1")
    p.add_argument("--latency-repeats", type=int, default=repeats, help="passes over them; the median counts")


def check_latency_options(args: argparse.Namespace) -> None:
    """Raise ValueError unless both latency options are positive."""
    if args.latency_texts < 1 or args.latency_repeats < 1:
        raise ValueError("--latency-texts and --latency-repeats must be at least 1")


def exec_command(prog: str, command: list[str], env: dict[str, str] | None = None) -> int:
    """Replace this process with ``command``; only a command that cannot start returns (127, one line)."""
    try:
        if env is None:
            os.execvp(command[0], command)
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"{prog}: error: {command[0]}: {e.strerror}", file=sys.stderr)
    return 127
