"""Budget -> head mask policy (docs/method.md §3), torch-free so that every layer can share it.

Gates: g_lh(b) = sigmoid((a_lh + beta_lh * logit(b)) / tau), with beta_lh = softplus(raw_lh) >= 0, so each
gate is monotone non-decreasing in b. Hard execution keeps k = round(b * L * H) heads (at least 1).

Which k heads: the paper keeps the k largest g_lh(b). That set is nested across budgets only empirically,
because two heads with different beta can swap order as b changes. The product promises nestedness (a
customer who pays more never loses a head, and the engine lays heads out so that every budget is a prefix
per layer), so we rank heads once by their *crossing budget* b*_lh = sigmoid(-a_lh / beta_lh), the budget at
which g_lh = 0.5, and budget b keeps the first k. This is the method's own notion of which heads a budget
buys: at budget b every head with b*_lh < b has g_lh(b) > 0.5 ("more on than off"), and every head with
b*_lh > b has g_lh(b) < 0.5, so the crossing-budget ranking agrees with the top-k of g(b) on every head whose
gate has decided; it only differs in how it orders undecided heads, where it picks the ones that switch on
earliest. Ties (equal crossing budgets) fall back to (layer, head) order, so masks are deterministic.
Stage-3 hard adaptation trains with this same ranking, so training and serving agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The 19-point evaluation grid 0.10, 0.15, ..., 1.00 (docs/method.md §10).
BUDGET_GRID: tuple[float, ...] = tuple(round(0.10 + 0.05 * i, 2) for i in range(19))

_BETA_FLOOR = 1e-12


@dataclass(frozen=True)
class GateParams:
    """Learned gate parameters as plain arrays: a (L, H) logits and beta (L, H) = softplus(raw) sensitivities."""

    a: np.ndarray
    beta: np.ndarray


def check_budget(budget: float) -> float:
    """Return ``budget`` as a float, or raise ValueError if it is not a finite number in [0, 1]."""
    b = float(budget)
    if not math.isfinite(b) or b < 0.0 or b > 1.0:
        raise ValueError(f"budget must be a number in [0, 1], got {budget!r}")
    return b


def soft_gates(params: GateParams, budget: float, tau: float, eps: float) -> np.ndarray:
    """g(b) for every head, shape (L, H); the soft cost C(b) is its mean."""
    b = min(max(check_budget(budget), eps), 1.0 - eps)
    z = (params.a.astype(np.float64) + params.beta.astype(np.float64) * math.log(b / (1.0 - b))) / tau
    return 1.0 / (1.0 + np.exp(-z))


def crossing_logits(params: GateParams) -> np.ndarray:
    """logit(b*) = -a / beta per head, shape (L, H): ranks like b* but never saturates to 0 or 1."""
    beta = np.maximum(params.beta.astype(np.float64), _BETA_FLOOR)
    return -params.a.astype(np.float64) / beta


def crossing_budgets(params: GateParams) -> np.ndarray:
    """b*_lh = sigmoid(-a_lh / beta_lh): the budget at which head (l, h) has gate 0.5, shape (L, H)."""
    return 1.0 / (1.0 + np.exp(-crossing_logits(params)))


def head_order(params: GateParams) -> np.ndarray:
    """Flat unit indices l * U + u, earliest crossing budget first, ties by (layer, unit); shape (L*U,).

    U is the gate units per layer: the H heads, then (whole-model scope) the feed-forward groups.
    """
    z = crossing_logits(params).ravel()
    idx = np.arange(z.size)
    # lexsort sorts by the last key first: crossing logit, then flat index (= layer, head order).
    return np.lexsort((idx, z)).astype(np.int64)


def n_kept(budget: float, n_layers: int, n_heads: int, structural: bool = False) -> int:
    """k = round(b * L * H), at least 1 (at least L in structural mode); halves round up, not to even."""
    b = check_budget(budget)
    k = max(1, int(math.floor(b * n_layers * n_heads + 0.5 + 1e-9)))
    if structural:
        k = max(k, n_layers)
    return min(k, n_layers * n_heads)


def keep_sequence(order: np.ndarray, n_layers: int, n_heads: int, structural: bool) -> np.ndarray:
    """The order in which heads are added as the budget grows; budget b keeps its first k entries.

    Structural mode first takes the best-ranked head of every layer (the per-layer floor), then continues
    in global rank order, so the kept sets stay nested.
    """
    if not structural:
        return order
    floor: list[int] = []
    seen_layers: set[int] = set()
    for flat in order.tolist():
        layer = flat // n_heads
        if layer not in seen_layers:
            seen_layers.add(layer)
            floor.append(flat)
    floor_set = set(floor)
    rest = [f for f in order.tolist() if f not in floor_set]
    return np.asarray(floor + rest, dtype=np.int64)


def head_mask(
    order: np.ndarray, budget: float, n_layers: int, n_heads: int, structural: bool = False
) -> np.ndarray:
    """Hard mask for ``budget``: bool array (L, H), True = head is computed."""
    k = n_kept(budget, n_layers, n_heads, structural)
    seq = keep_sequence(order, n_layers, n_heads, structural)
    mask = np.zeros(n_layers * n_heads, dtype=bool)
    mask[seq[:k]] = True
    return mask.reshape(n_layers, n_heads)


def cost_prefix(order: np.ndarray, budget: float, costs: np.ndarray) -> int:
    """Length of the longest prefix of ``order`` whose cost is at most b * sum(costs), at least 1.

    docs/method.md §4.2: units of unequal cost (heads, feed-forward groups) are kept in ranking order until
    the budget's share of their multiply-adds is spent; the ranking is fixed, so kept sets are nested in b.
    """
    spent = np.cumsum(costs.reshape(-1)[order].astype(np.float64))  # (U_total,)
    # The relative slack keeps b = 1 (and budgets that land exactly on a boundary) from losing a unit to rounding.
    k = int(np.searchsorted(spent, check_budget(budget) * spent[-1] * (1.0 + 1e-12), side="right"))
    return max(1, min(k, spent.size))


def layer_head_orders(order: np.ndarray, n_layers: int, n_heads: int) -> np.ndarray:
    """Per-layer head permutation, shape (L, H): in every layer, heads in global rank order.

    Because kept sets are nested, the heads a budget keeps in layer l are always a prefix of row l.
    """
    rows: list[list[int]] = [[] for _ in range(n_layers)]
    for flat in order.tolist():
        rows[flat // n_heads].append(flat % n_heads)
    return np.asarray(rows, dtype=np.int64)
