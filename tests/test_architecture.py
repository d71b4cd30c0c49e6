"""The dependency direction of STYLE.md, checked with import-linter's contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is part of the dev extra"
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "0 broken" in proc.stdout


def _map_rows() -> dict[str, set[str]]:
    """docs/architecture.md's closing map: module -> the modules it may not import (a row "(as X)" is X's)."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text[text.index("\n## Map"):]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`").rstrip("/").replace("/", ".")] = cells[2]

    def module(name: str) -> str:
        name = name.strip()
        return f"headbudget.{name}" if (ROOT / "headbudget" / name.replace(".", "/")).exists() or \
            (ROOT / "headbudget" / f"{name.replace('.', '/')}.py").exists() else name

    out: dict[str, set[str]] = {}
    for folder, cell in rows.items():
        same = re.fullmatch(r"\(as `([^`]+)`\)", cell)
        cell = rows[same.group(1).rstrip("/").replace("/", ".")] if same else cell
        names = [re.sub(r"\s*\(.*\)$", "", n) for n in cell.split(", ")] if not cell.startswith("(") else []
        out[folder] = {module(n) for n in names if n}
    return out


def _forbidden_contracts() -> list[tuple[list[str], list[str]]]:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return [(c["source_modules"], c["forbidden_modules"]) for c in contracts if c["type"] == "forbidden"]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_architecture_map_matches_the_import_contracts() -> None:
    rows, contracts = _map_rows(), _forbidden_contracts()
    assert "headbudget.models" in rows and "headbudget.service" in rows, "docs/architecture.md ends with its map"
    unbacked = [f"{src} -> {dst}" for src, dsts in rows.items() for dst in dsts
                if not any(any(_within(src, s) for s in sources) and any(_within(dst, f) for f in forbidden)
                           for sources, forbidden in contracts)]
    assert not unbacked, f"the map forbids imports no contract forbids: {unbacked}"
    unmapped = [f"{s} -> {f}" for sources, forbidden in contracts for s in sources for f in forbidden
                if not any(_within(src, s) and f in dsts for src, dsts in rows.items())]
    assert not unmapped, f"contracts the map does not show: {unmapped}"
