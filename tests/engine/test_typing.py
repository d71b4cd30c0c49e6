"""mypy (strict settings from pyproject.toml) passes on headbudget.engine."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e .[dev])")
def test_engine_passes_mypy_strict() -> None:
    # -p with the package name, resolved from the repository root: modules are headbudget.engine.*, which is
    # what the strict override in pyproject.toml names.
    proc = subprocess.run([sys.executable, "-m", "mypy", "-p", "headbudget.engine"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
