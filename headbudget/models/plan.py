"""The execution plan: what one forward pass runs, per layer, and what that costs (torch-free).

A budget (or an input-adaptive model's cap) turns into a plan here, once: ``BudgetPolicy.plan`` for the budgeted
checkpoint's nested head ranking (docs/method.md §3). The engine executes plans, the service batches requests
whose plans share a ``key`` and reports their ``cost``; nothing else needs to know what a budget buys. A plan
keeps a prefix of each layer's head order and, when the budget spans the whole model (docs/method.md §4), a
prefix of each layer's feed-forward neuron order; with exits (layer skipping) it may also stop after a layer
(``depth``), which keeps no unit above it, so the cost terms below need nothing new for it.

Cost is counted in multiply-adds (MACs) per layer, with k active heads of width d_h, n tokens, width D,
feed-forward width I:
    attention = 3·n·D·k·d_h (Q/K/V) + n·n·d_h·k (scores) + n·n·d_h·k (values) + n·k·d_h·D (output projection)
    FFN       = 2·n·D·I' (I' of the I neurons computed)
plus the classifier D·C on the pooled vector. Embedding lookups, LayerNorms, softmax, GELU, biases and the
pooling sum are not multiply-adds of a weight matrix and are left out, as in the usual transformer FLOP counts.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from headbudget.models.budget import check_budget, cost_prefix, head_mask, layer_head_orders
from headbudget.models.config import ModelConfig


@dataclass(frozen=True)
class Shape:
    """The dimensions of the encoder that the MAC count depends on."""

    hidden: int  # D
    n_heads: int  # H per layer
    head_dim: int  # d_h
    intermediate: int  # I
    n_labels: int  # C

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shape:
        return cls(cfg.hidden_size, cfg.n_heads, cfg.head_dim, cfg.intermediate_size, cfg.n_labels)


@dataclass(frozen=True)
class Cost:
    """What one forward pass of one text cost, at its real (unpadded) length."""

    heads_active: int
    heads_total: int
    attention_macs: int  # Q/K/V/O projections + score and value products of active heads
    attention_macs_dense: int  # the same with every head active
    total_macs: int  # whole forward pass (attention + feed-forward + classifier)
    total_macs_dense: int
    neurons_active: int = 0  # feed-forward neurons computed, summed over layers
    neurons_total: int = 0

    @property
    def attention_ratio(self) -> float:
        """Fraction of the dense attention multiply-adds spent."""
        return self.attention_macs / self.attention_macs_dense if self.attention_macs_dense else 0.0

    @property
    def attention_saved(self) -> int:
        return self.attention_macs_dense - self.attention_macs

    @property
    def ratio(self) -> float:
        """Fraction of the dense whole forward pass's multiply-adds spent (the ``cost`` the service reports)."""
        return self.total_macs / self.total_macs_dense if self.total_macs_dense else 0.0

    @property
    def saved(self) -> int:
        """Whole-forward multiply-adds not spent."""
        return self.total_macs_dense - self.total_macs


def attention_macs(shape: Shape, heads: int, n_tokens: int) -> int:
    """MACs of one attention block running ``heads`` heads on ``n_tokens`` tokens."""
    n, d, w = n_tokens, shape.hidden, heads * shape.head_dim
    return 3 * n * d * w + 2 * n * n * w + n * w * d


def ffn_macs(shape: Shape, n_tokens: int, neurons: int | None = None) -> int:
    """MACs of one feed-forward block (two linear layers) computing ``neurons`` of its neurons (all: None)."""
    return 2 * n_tokens * shape.hidden * (shape.intermediate if neurons is None else neurons)


@dataclass(frozen=True)
class ExecutionPlan:
    """What one forward pass runs: in layer l, the first ``heads[l]`` heads of that layer's head order and,
    when the budget spans the whole model, the first ``ffn[l]`` feed-forward neurons of its neuron order."""

    heads: tuple[int, ...]
    n_heads: int  # heads per layer in the model
    ffn: tuple[int, ...] | None = None  # neurons per layer; None: every neuron (attention-scope budgets)
    # Layers run, when the plan stops at an exit (every layer from ``depth`` on keeps no unit and is skipped,
    # and the exit's own head answers); None: every layer, and the model's classifier.
    depth: int | None = None

    @property
    def key(self) -> Hashable:
        """Requests whose plans have equal keys run the same computation, so they can share a batch."""
        key = self.heads if self.ffn is None else (self.heads, self.ffn)
        return key if self.depth is None else (key, self.depth)

    @property
    def layers_run(self) -> int:
        """How many layers the forward pass runs (all of them unless the plan stops at an exit)."""
        return len(self.heads) if self.depth is None else self.depth

    @property
    def heads_active(self) -> int:
        return sum(self.heads)

    @property
    def heads_total(self) -> int:
        return len(self.heads) * self.n_heads

    def ffn_widths(self, intermediate: int) -> tuple[int, ...]:
        """Neurons computed per layer: the plan's, or all ``intermediate`` of them (attention-scope plans)."""
        return self.ffn if self.ffn is not None else (intermediate,) * len(self.heads)

    def cost(self, shape: Shape, n_tokens: int) -> Cost:
        """The plan's cost for one text of ``n_tokens`` tokens."""
        n_layers = len(self.heads)
        attn = sum(attention_macs(shape, k, n_tokens) for k in self.heads)
        attn_dense = n_layers * attention_macs(shape, shape.n_heads, n_tokens)
        widths = self.ffn_widths(shape.intermediate)
        ffn = sum(ffn_macs(shape, n_tokens, w) for w in widths)
        ffn_dense = n_layers * ffn_macs(shape, n_tokens)
        head = shape.hidden * shape.n_labels
        return Cost(heads_active=self.heads_active, heads_total=self.heads_total, attention_macs=attn,
                    attention_macs_dense=attn_dense, total_macs=attn + ffn + head,
                    total_macs_dense=attn_dense + ffn_dense + head, neurons_active=sum(widths),
                    neurons_total=n_layers * shape.intermediate)

    def flop_bound_speedup(self, shape: Shape, n_tokens: int) -> float:
        """The speedup over the dense forward pass if time were proportional to multiply-adds."""
        cost = self.cost(shape, n_tokens)
        return cost.total_macs_dense / cost.total_macs


def uniform_plan(cfg: ModelConfig, heads_per_layer: int) -> ExecutionPlan:
    """The same head count in every layer (the dense model, or an adaptive type's per-layer cap)."""
    return ExecutionPlan(heads=(heads_per_layer,) * cfg.n_layers, n_heads=cfg.n_heads)


def unit_costs(cfg: ModelConfig) -> np.ndarray:
    """Each gate unit's multiply-adds at the reference length, (L, U): heads, then feed-forward groups."""
    shape, n = Shape.of(cfg), cfg.gate.ref_length
    row = [attention_macs(shape, 1, n)] * cfg.n_heads + [ffn_macs(shape, n, cfg.gate.ffn_group)] * cfg.ffn_groups
    return np.tile(np.asarray(row, dtype=np.float64), (cfg.n_layers, 1))


def soft_cost_weights(cfg: ModelConfig) -> np.ndarray | None:
    """Weights of C(b) = sum_u w_u g_u(b) over (L, U) units, summing to 1; None: the plain mean (attention).

    Attention scope keeps docs/method.md §2's mean over heads exactly (a weighted mean with equal weights
    rounds differently, and the sweep of an attention checkpoint must not change by a bit).
    """
    if not cfg.gate.scope_spec.gates_ffn:
        return None
    costs = unit_costs(cfg)
    return costs / costs.sum()  # type: ignore[no-any-return]


def exit_sequence(order: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The keep sequence of a checkpoint with exits: the ranking's units of layers below the first exit, then
    those below the next exit (or the top), each part in ranking order, so each layer's own order is unchanged."""
    upl, bounds = cfg.units_per_layer, (0, *cfg.gate.exits, cfg.n_layers)
    layer = order // upl
    parts = [order[(layer >= lo) & (layer < hi)] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    return np.concatenate(parts).astype(np.int64)


class BudgetPolicy:
    """budget -> plan for a budgeted checkpoint: the hard mask of its unit ranking, as per-layer prefixes."""

    def __init__(self, cfg: ModelConfig, order: np.ndarray) -> None:
        self.cfg = cfg
        # flat unit ranking, (L*U,); with exits, the order in which budgets keep units (exit_sequence)
        self.order = exit_sequence(order, cfg) if cfg.gate.exits else order
        h = cfg.n_heads
        units = layer_head_orders(order, cfg.n_layers, cfg.units_per_layer)  # (L, U) per-layer unit ranking
        self.perms = np.stack([row[row < h] for row in units])  # (L, H) heads in rank order
        # (L, G) feed-forward groups in rank order; (L, 0) in the attention scope.
        self.ffn_perms = np.stack([row[row >= h] - h for row in units])
        self._costs = unit_costs(cfg) if cfg.gate.scope_spec.gates_ffn else None

    @property
    def neuron_perms(self) -> np.ndarray:
        """(L, I) feed-forward neurons in rank order (a group's neurons stay together and in order)."""
        g = self.cfg.gate.ffn_group
        if self._costs is None:
            return np.tile(np.arange(self.cfg.intermediate_size, dtype=np.int64), (self.cfg.n_layers, 1))
        return (self.ffn_perms[:, :, None] * g + np.arange(g)[None, None, :]).reshape(self.cfg.n_layers, -1)

    def mask(self, budget: float) -> np.ndarray:
        """The hard mask, (L, U) bool: the heads, then the feed-forward groups."""
        c = self.cfg
        if self._costs is None:
            return head_mask(self.order, check_budget(budget), c.n_layers, c.n_heads, c.gate.structural)
        k = cost_prefix(self.order, budget, self._costs)
        mask = np.zeros(self.order.size, dtype=bool)
        mask[self.order[:k]] = True
        return mask.reshape(c.n_layers, c.units_per_layer)

    def hard_cost(self, budget: float) -> float:
        """What the hard mask keeps: k / (L * H) heads (attention), or its share of the unit MACs (model)."""
        mask = self.mask(budget)
        if self._costs is None:
            return float(mask.sum()) / mask.size
        return float((self._costs * mask).sum() / self._costs.sum())

    def plan(self, budget: float) -> ExecutionPlan:
        """The plan for ``budget``; each layer's kept heads and groups lead its ``perms`` / ``ffn_perms`` (checked)."""
        mask = self.mask(budget)
        h = self.cfg.n_heads
        heads, groups = mask[:, :h], mask[:, h:]
        for layer in range(self.cfg.n_layers):  # nestedness is what makes slices prefixes
            k, g = int(heads[layer].sum()), int(groups[layer].sum())
            if not heads[layer, self.perms[layer, :k]].all() or not groups[layer, self.ffn_perms[layer, :g]].all():
                raise AssertionError(f"layer {layer}: kept units are not a prefix of the unit order")
        counts = tuple(int(x) for x in heads.sum(axis=1))
        ffn = None if self._costs is None else tuple(int(x) * self.cfg.gate.ffn_group for x in groups.sum(axis=1))
        return ExecutionPlan(heads=counts, n_heads=h, ffn=ffn, depth=self.depth(mask))

    def depth(self, mask: np.ndarray) -> int | None:
        """The first exit at or above every layer that keeps a unit (None: no exit fits, run every layer)."""
        used = np.flatnonzero(mask.any(axis=1))
        top = int(used[-1]) + 1 if used.size else 1
        return next((e for e in self.cfg.gate.exits if e >= top), None)
