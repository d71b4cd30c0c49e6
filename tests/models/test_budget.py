"""The head-mask policy: monotone gates, exact k, nested and deterministic masks."""

from __future__ import annotations

import numpy as np
import pytest

from headbudget.models.budget import (
    BUDGET_GRID,
    GateParams,
    check_budget,
    head_mask,
    head_order,
    layer_head_orders,
    n_kept,
    soft_gates,
)


def random_params(seed: int, n_layers: int = 6, n_heads: int = 12) -> GateParams:
    rng = np.random.default_rng(seed)
    return GateParams(a=rng.normal(0, 3, (n_layers, n_heads)), beta=np.log1p(np.exp(rng.normal(0, 1.5, (n_layers, n_heads)))))


def test_grid_is_the_19_point_protocol() -> None:
    assert len(BUDGET_GRID) == 19 and BUDGET_GRID[0] == 0.1 and BUDGET_GRID[-1] == 1.0
    assert np.allclose(np.diff(BUDGET_GRID), 0.05)


@pytest.mark.parametrize("seed", range(5))
def test_soft_gates_monotone_in_budget(seed: int) -> None:
    p = random_params(seed)
    budgets = np.linspace(0.0, 1.0, 101)
    g = np.stack([soft_gates(p, b, tau=1.0, eps=1e-3) for b in budgets])  # (101, L, H)
    assert np.all(np.diff(g, axis=0) >= -1e-12)
    assert np.all(np.diff(g.mean(axis=(1, 2))) >= -1e-12)  # so is the soft cost C(b)


@pytest.mark.parametrize("structural", [False, True])
def test_exact_k(structural: bool) -> None:
    order = head_order(random_params(1))
    for b in BUDGET_GRID:
        mask = head_mask(order, b, 6, 12, structural)
        k = max(1, int(np.floor(b * 72 + 0.5)))
        assert mask.sum() == (max(k, 6) if structural else k) == n_kept(b, 6, 12, structural)
        if structural:
            assert mask.any(axis=1).all(), "structural mode keeps a head in every layer"
    assert n_kept(0.0, 6, 12) == 1  # at least one head
    assert n_kept(0.125, 2, 4) == 1  # 0.125 * 8 = 1.0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("structural", [False, True])
def test_masks_nested_over_fine_budgets(seed: int, structural: bool) -> None:
    order = head_order(random_params(seed))
    budgets = np.linspace(0.0, 1.0, 301)
    masks = [head_mask(order, float(b), 6, 12, structural) for b in budgets]
    for lo, hi in zip(masks, masks[1:], strict=False):
        assert np.all(lo <= hi)


def test_masks_are_prefixes_of_the_per_layer_order() -> None:
    order = head_order(random_params(2))
    rows = layer_head_orders(order, 6, 12)
    for b in BUDGET_GRID:
        mask = head_mask(order, b, 6, 12)
        for layer in range(6):
            k = int(mask[layer].sum())
            assert set(rows[layer, :k].tolist()) == set(np.flatnonzero(mask[layer]).tolist())


def test_ties_break_by_layer_then_head() -> None:
    p = GateParams(a=np.zeros((2, 3)), beta=np.ones((2, 3)))  # every head crosses at b = 0.5
    assert head_order(p).tolist() == [0, 1, 2, 3, 4, 5]
    assert head_mask(head_order(p), 0.5, 2, 3).tolist() == [[True, True, True], [False, False, False]]


def test_masks_deterministic() -> None:
    p = random_params(3)
    first = [head_mask(head_order(p), b, 6, 12) for b in BUDGET_GRID]
    again = [head_mask(head_order(GateParams(p.a.copy(), p.beta.copy())), b, 6, 12) for b in BUDGET_GRID]
    assert all(np.array_equal(x, y) for x, y in zip(first, again, strict=True))


def test_crossing_budget_ranking_matches_decided_gates() -> None:
    # A head whose gate is above 0.5 at b is always kept before one whose gate is below 0.5.
    p = random_params(4)
    order = head_order(p)
    for b in BUDGET_GRID:
        g = soft_gates(p, b, tau=1.0, eps=1e-3).ravel()
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        on, off = np.flatnonzero(g > 0.5), np.flatnonzero(g < 0.5)
        if on.size and off.size:
            assert rank[on].max() < rank[off].min()


@pytest.mark.parametrize("bad", [-0.1, 1.01, float("nan"), float("inf"), "x"])
def test_bad_budgets_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        check_budget(bad)  # type: ignore[arg-type]
