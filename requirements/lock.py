"""The committed resolution: one hashed requirements file per environment, written by uv from pyproject.toml.

    python3 requirements/lock.py check                      # exit 1, one line, when a lock is stale
    python3 requirements/lock.py write --find-links DIR [--upgrade]
    python3 requirements/lock.py torch                      # pyproject.toml's torch pin

`check` needs only the standard library (it runs before any virtual environment exists): each lock's first line
holds a digest of what it was resolved from (Python version, platform, the pyproject.toml requirements of its
extras), so a change to any of them without a new lock fails the install instead of resolving anew.
`write` resolves with uv; DIR holds the CPU torch wheel (the Makefile downloads it), so the lock pins that file's
hash and not the CUDA build the registry serves under the same version. Without --upgrade uv keeps every pin
that still fits; with it, the newest releases are taken and the changed pins are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
PYTHON = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
DIGEST = re.compile(r"^# inputs sha256 ([0-9a-f]{64})$")
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)")


@dataclass(frozen=True)
class Lock:
    """One environment: the extras it installs and the file that pins them."""
    name: str
    extras: tuple[str, ...]
    note: str

    @property
    def path(self) -> Path:
        return ROOT / "requirements" / f"{self.name}.txt"


LOCKS = (
    # make install, make test, make run, CI; the Docker image takes its serve subset from this file
    Lock("main", ("serve", "torch", "train", "minilm", "loadtest", "dev"), "the project's environment (.venv)"),
    # optimum-onnx needs transformers < 4.58 where training needs 5: its own environment (.venv-optimum)
    Lock("optimum", ("optimum",), "the export check's environment (.venv-optimum)"),
)


def inputs_digest(lock: Lock) -> str:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    missing = [e for e in lock.extras if e not in extras]
    if missing:
        raise SystemExit(f"error: pyproject.toml has no extra {', '.join(missing)} (requirements/lock.py)")
    what = {"python": PYTHON, "platform": PLATFORM, "requires-python": project.get("requires-python"),
            "dependencies": sorted(project.get("dependencies", [])) if lock.name == "main" else [],
            "extras": {e: sorted(extras[e]) for e in lock.extras}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def recorded_digest(lock: Lock) -> str | None:
    if not lock.path.exists():
        return None
    first = lock.path.read_text().splitlines()[:1]
    m = DIGEST.match(first[0]) if first else None
    return m.group(1) if m else None


def pins(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    return {m.group(1).lower(): m.group(2) for line in path.read_text().splitlines() if (m := PIN.match(line))}


def check() -> int:
    stale = [lock for lock in LOCKS if recorded_digest(lock) != inputs_digest(lock)]
    for lock in stale:
        print(f"error: {lock.path.relative_to(ROOT)} is stale against pyproject.toml ({lock.note}); "
              "run `make lock` to resolve again and test", file=sys.stderr)
    return 1 if stale else 0


def write(find_links: Path, upgrade: bool, uv: str) -> int:
    for lock in LOCKS:
        before = pins(lock.path)
        body = lock.path.with_suffix(".tmp")
        extras = [a for e in lock.extras for a in ("--extra", e)]
        cmd = [uv, "pip", "compile", "--quiet", str(PYPROJECT.relative_to(ROOT)), *extras, "--python-version", PYTHON,
               "--python-platform", PLATFORM, "--generate-hashes", "--find-links", str(find_links),
               "--no-header", "--output-file", str(body)]
        if lock.path.exists():
            body.write_text(lock.path.read_text())  # uv keeps the pins of the file it writes over
        if upgrade:
            cmd.append("--upgrade")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            body.unlink(missing_ok=True)
            print(f"error: uv could not resolve {lock.name}: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        head = (f"# inputs sha256 {inputs_digest(lock)}\n"
                f"# {lock.note}: pyproject.toml's extras {', '.join(lock.extras)}, Python {PYTHON}, {PLATFORM}.\n"
                "# Written by `make lock` (requirements/lock.py); do not edit by hand.\n")
        lock.path.write_text(head + body.read_text())
        body.unlink()
        after = pins(lock.path)
        changed = [f"  {n} {before.get(n, '-')} -> {after.get(n, '-')}" for n in sorted(before.keys() | after.keys())
                   if before.get(n) != after.get(n)]
        print(f"{lock.path.relative_to(ROOT)}: {len(after)} pins, {len(changed)} changed")
        if changed:
            print("\n".join(changed))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="exit 1 when a lock is stale against pyproject.toml")
    sub.add_parser("torch", help="print pyproject.toml's torch requirement (the wheel `write` resolves with)")
    w = sub.add_parser("write", help="resolve every lock with uv")
    w.add_argument("--find-links", type=Path, required=True, help="folder holding the CPU torch wheel")
    w.add_argument("--upgrade", action="store_true", help="take the newest releases instead of keeping pins")
    w.add_argument("--uv", default="uv", help="the uv binary")
    args = p.parse_args(argv)
    if args.cmd == "torch":
        torch = [r for r in tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["torch"]
                 if r.startswith("torch")]
        print(torch[0])
        return 0
    return check() if args.cmd == "check" else write(args.find_links, args.upgrade, args.uv)


if __name__ == "__main__":
    sys.exit(main())
