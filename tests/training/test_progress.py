"""The training progress bar shows what each stage varies: a budget only in the stages whose loss takes one."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from headbudget.models.config import GateConfig
from headbudget.models.pretrained import random_init
from headbudget.training.batches import TokenizedSplit
from headbudget.training.recipes import get_recipe
from headbudget.training.stages import run_stage


def _split(n: int, seed: int) -> TokenizedSplit:
    rng = np.random.default_rng(seed)
    return TokenizedSplit([list(rng.integers(5, 90, size=int(rng.integers(4, 12)))) for _ in range(n)],
                          rng.integers(0, 2, size=n).astype(np.int64), 0)


@pytest.mark.parametrize(("stage", "shows_budget"), [("dense", False), ("budget", True)])
def test_the_bar_shows_a_budget_only_where_the_stage_samples_one(
        stage: str, shows_budget: bool, capsys: pytest.CaptureFixture[str]) -> None:
    model = random_init(("a", "b"), GateConfig(scope="model"), seed=0)
    recipe = replace(get_recipe("smoke"), dense_epochs=1, budget_epochs=1, batch_size=8, val_budgets=(0.5, 1.0))
    run_stage(model, stage, recipe, _split(16, 0), _split(8, 1), seed=0)  # type: ignore[arg-type]
    bar = capsys.readouterr().err
    assert "loss=" in bar and "val=" in bar
    assert ("b=" in bar) is shows_budget, bar
