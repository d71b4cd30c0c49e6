"""Fixtures of the load-test tests: the live service of tests/ops/live.py (one server for both packages), a small
AG News-shaped data folder, and the check that a tool's bad input is one error line."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.ops.live import live_service  # noqa: F401  (a session fixture, started only by tests that use it)


def data_folder(folder: Path) -> Path:
    """A folder with a test.csv of 12 texts of one to five times 26 characters (the tools' --data)."""
    folder.mkdir()
    with open(folder / "test.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text", "label"])
        w.writeheader()
        w.writerows({"text": " ".join(["red marker four pink blue"] * (1 + i % 5)) + f" {i}", "label": "0"}
                    for i in range(12))
    return folder


def assert_one_line_error(main: Callable[[list[str]], int], argv: list[str], tool: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """``main(argv)`` exits 2 (its own checks or argparse's) with one line on stderr naming ``tool``."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own checks
        rc = e.code  # type: ignore[assignment]
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{tool}: error:" in err and err.count("\n") == 1
