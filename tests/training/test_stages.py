"""run_stage: what a stage keeps, and the evaluation it skips when that would select nothing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from headbudget.models.config import GateConfig
from headbudget.models.pretrained import random_init
from headbudget.training.batches import TokenizedSplit
from headbudget.training.recipes import get_recipe
from headbudget.training.stages import run_stage

LABELS = ("a", "b")


def _split(n: int, seed: int) -> TokenizedSplit:
    rng = np.random.default_rng(seed)
    ids = [[101, *rng.integers(1000, 2000, size=int(rng.integers(3, 12))).tolist(), 102] for _ in range(n)]
    return TokenizedSplit(ids, rng.integers(0, len(LABELS), size=n).astype(np.int64), 0)


def test_a_last_stage_whose_caller_measures_it_skips_its_lone_evaluation_and_keeps_the_same_weights() -> None:
    recipe = replace(get_recipe("smoke"), examples_per_stage=64, budget_epochs=1)  # 2 steps, one evaluation
    train, val = _split(64, 0), _split(16, 1)
    runs = {}
    for final in (True, False):
        model = random_init(LABELS, GateConfig(scope="model"), seed=3)
        runs[final] = (model, run_stage(model, "budget", recipe, train, val, seed=7, final=final))
    (evaluated, with_eval), (skipped, without) = runs[True], runs[False]
    assert with_eval.steps == without.steps == 2
    assert with_eval.best_val is not None and len(with_eval.history) == 1
    assert without.best_val is None and without.history == []
    for (name, a), b in zip(evaluated.state_dict().items(), skipped.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_stage_that_evaluates_more_than_once_still_selects_when_not_final() -> None:
    recipe = replace(get_recipe("smoke"), examples_per_stage=64, budget_epochs=1, evals_per_epoch=2)
    model = random_init(LABELS, GateConfig(scope="model"), seed=3)
    result = run_stage(model, "budget", recipe, _split(64, 0), _split(16, 1), seed=7, final=False)
    assert len(result.history) == 2 and result.best_val is not None
