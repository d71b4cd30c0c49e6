"""The execution plan: MAC accounting hand-checked on the tiny shape, keys, the budget policy, and the
engine's answers costed by its plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.budget import BUDGET_GRID, GateParams, head_order, n_kept
from headbudget.models.config import ModelConfig
from headbudget.models.plan import BudgetPolicy, ExecutionPlan, Shape, attention_macs, uniform_plan

TINY = Shape(hidden=64, n_heads=4, head_dim=16, intermediate=256, n_labels=2)


def test_attention_macs_by_hand() -> None:
    # n = 10, k = 2 heads of 16: Q/K/V 3*10*64*32 = 61440, scores+values 2*10*10*32 = 6400, O 10*32*64 = 20480.
    assert attention_macs(TINY, 2, 10) == 61440 + 6400 + 20480
    assert attention_macs(TINY, 0, 10) == 0


def test_plan_cost_by_hand() -> None:
    plan = ExecutionPlan(heads=(2, 0), n_heads=4)
    cost = plan.cost(TINY, 10)
    ffn = 2 * 10 * 64 * 256
    assert cost.attention_macs == 88320
    assert cost.attention_macs_dense == 2 * attention_macs(TINY, 4, 10)
    assert cost.total_macs == 88320 + 2 * ffn + 64 * 2
    assert (cost.heads_active, cost.heads_total) == (2, 8) == (plan.heads_active, plan.heads_total)
    assert cost.attention_ratio == pytest.approx(88320 / cost.attention_macs_dense)
    assert ExecutionPlan(heads=(4, 4), n_heads=4).flop_bound_speedup(TINY, 10) == 1.0
    assert plan.flop_bound_speedup(TINY, 10) == pytest.approx(cost.total_macs_dense / cost.total_macs)


def test_plans_that_run_the_same_heads_share_a_key() -> None:
    cfg = ModelConfig(hidden_size=64, n_layers=2, n_heads=4, intermediate_size=256)
    assert uniform_plan(cfg, 4).key == ExecutionPlan(heads=(4, 4), n_heads=4).key
    assert ExecutionPlan(heads=(3, 1), n_heads=4).key != ExecutionPlan(heads=(1, 3), n_heads=4).key
    assert len({ExecutionPlan(heads=(2, 2), n_heads=4).key, ExecutionPlan(heads=(2, 2), n_heads=4).key}) == 1


def test_budget_policy_plans_are_nested_prefixes_with_the_masks_head_count() -> None:
    cfg = ModelConfig(hidden_size=64, n_layers=3, n_heads=4, intermediate_size=256)
    rng = np.random.default_rng(0)
    policy = BudgetPolicy(cfg, head_order(GateParams(a=rng.normal(size=(3, 4)), beta=rng.uniform(0.1, 2, (3, 4)))))
    previous = None
    for b in BUDGET_GRID:
        plan = policy.plan(b)
        assert plan.heads_active == n_kept(b, 3, 4) == int(policy.mask(b).sum())
        if previous is not None:  # a higher budget keeps at least the heads of a lower one, layer by layer
            assert all(x >= y for x, y in zip(plan.heads, previous, strict=True))
        previous = plan.heads


def test_engine_answers_are_costed_by_their_plan(tiny_checkpoint: Path, tmp_path: Path) -> None:
    engine = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    for b in BUDGET_GRID:
        result = engine.predict(["one text", "and a second, longer text"], b)
        k = n_kept(b, 2, 4)
        assert result.heads_active == k and result.heads_total == 8
        for p in result.predictions:
            assert p.cost.heads_active == k
            assert p.cost == engine.plan(b).cost(TINY, p.n_tokens)
