"""The JSON document a ``python -m lab.X`` script writes, with the command that made it."""

from __future__ import annotations

import json
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
