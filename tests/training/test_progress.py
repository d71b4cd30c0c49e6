"""A stage's progress is one plain line per tenth of its steps when the output is not a terminal, and shows what
each stage varies: a budget only in the stages whose loss takes one, a validation figure only once there is one."""

from __future__ import annotations

import io
import logging
from dataclasses import replace

import numpy as np
import pytest

from headbudget.models.config import GateConfig
from headbudget.models.pretrained import random_init
from headbudget.training.batches import TokenizedSplit
from headbudget.training.progress import LINES_PER_STAGE, Progress
from headbudget.training.recipes import get_recipe
from headbudget.training.stages import run_stage


def _split(n: int, seed: int) -> TokenizedSplit:
    rng = np.random.default_rng(seed)
    return TokenizedSplit([list(rng.integers(5, 90, size=int(rng.integers(4, 12)))) for _ in range(n)],
                          rng.integers(0, 2, size=n).astype(np.int64), 0)


@pytest.mark.parametrize(("stage", "shows_budget"), [("dense", False), ("budget", True)])
def test_the_progress_shows_a_budget_only_where_the_stage_samples_one(
        stage: str, shows_budget: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="headbudget.training")
    model = random_init(("a", "b"), GateConfig(scope="model"), seed=0)
    recipe = replace(get_recipe("smoke"), dense_epochs=2, budget_epochs=2, batch_size=8, val_budgets=(0.5, 1.0))
    run_stage(model, stage, recipe, _split(16, 0), _split(8, 1), seed=0)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all(f"{stage}: step " in line and "loss " in line for line in lines)
    assert all((", b " in line) is shows_budget for line in lines), lines
    # one evaluation per epoch: none before the first epoch ends, one figure after it
    assert ["val " in line for line in lines] == [False, False, True, True], lines


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
