"""A stage's progress is one plain line per tenth of its steps when the output is not a terminal."""

from __future__ import annotations

import io
import logging

import pytest

from headbudget.training.progress import LINES_PER_STAGE, Progress


def test_progress_off_a_terminal_is_a_few_plain_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="headbudget.training")
    stream = io.StringIO()
    bar = Progress(125, "dense", stream=stream)
    for step in range(125):
        bar.update(loss=f"{1 / (step + 1):.3f}")
    bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert stream.getvalue() == ""  # no bar, no carriage returns
    assert LINES_PER_STAGE <= len(lines) <= LINES_PER_STAGE + 1
    assert lines[-1].startswith("dense: step 125/125, loss 0.008, ")
    assert all("\r" not in line and len(line) < 120 for line in lines)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_bar(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="headbudget.training")
    stream = _Terminal()
    bar = Progress(20, "budget", stream=stream)
    for _ in range(20):
        bar.update(loss="0.1")
    bar.close()
    assert "20/20" in stream.getvalue() and not caplog.records
