"""MAC accounting, hand-checked on the tiny shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from headbudget.engine.cost import Shape, attention_macs, flop_bound_speedup, forward_cost
from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.budget import BUDGET_GRID, n_kept

TINY = Shape(hidden=64, n_heads=4, head_dim=16, intermediate=256, n_labels=2)


def test_attention_macs_by_hand() -> None:
    # n = 10, k = 2 heads of 16: Q/K/V 3*10*64*32 = 61440, scores+values 2*10*10*32 = 6400, O 10*32*64 = 20480.
    assert attention_macs(TINY, 2, 10) == 61440 + 6400 + 20480
    assert attention_macs(TINY, 0, 10) == 0


def test_forward_cost_by_hand() -> None:
    cost = forward_cost(TINY, (2, 0), 10)
    ffn = 2 * 10 * 64 * 256
    assert cost.attention_macs == 88320
    assert cost.attention_macs_dense == 2 * attention_macs(TINY, 4, 10)
    assert cost.total_macs == 88320 + 2 * ffn + 64 * 2
    assert (cost.heads_active, cost.heads_total) == (2, 8)
    assert cost.attention_ratio == pytest.approx(88320 / cost.attention_macs_dense)
    assert flop_bound_speedup(TINY, (4, 4), 10) == 1.0
    assert flop_bound_speedup(TINY, (2, 0), 10) == pytest.approx(cost.total_macs_dense / cost.total_macs)


def test_engine_reports_exact_head_fraction_and_cost(tiny_checkpoint: Path, tmp_path: Path) -> None:
    engine = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    for b in BUDGET_GRID:
        result = engine.predict(["one text", "and a second, longer text"], b)
        k = n_kept(b, 2, 4)
        assert result.heads_active == k and result.heads_total == 8
        for p in result.predictions:
            assert p.cost.heads_active == k
            assert p.cost == forward_cost(TINY, engine.layer_counts(b), p.n_tokens)  # type: ignore[attr-defined]
