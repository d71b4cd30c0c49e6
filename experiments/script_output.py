"""The JSON document a ``python -m headbudget.experiments.X`` script writes, with the command that made it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def write_doc(doc: dict[str, Any], out: Path, module: str, argv: list[str] | None) -> None:
    """Record the exact command in ``doc`` (so results.md can quote it) and write it to ``out``."""
    doc["command"] = f"python -m headbudget.experiments.{module} " + " ".join(sys.argv[1:] if argv is None else argv)
    out.write_text(json.dumps(doc, indent=1) + "\n")
