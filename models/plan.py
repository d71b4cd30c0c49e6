"""The execution plan: what one forward pass runs, per layer, and what that costs (torch-free).

A budget (or an input-adaptive model's cap) turns into a plan here, once: ``BudgetPolicy.plan`` for the budgeted
checkpoint's nested head ranking (METHODS.md section 1). The engine executes plans, the service batches requests
whose plans share a ``key`` and reports their ``cost``; nothing else needs to know what a budget buys. Today a
plan keeps a prefix of each layer's head order; a new unit (feed-forward width, skipping a layer) is a new field
here, its cost term below, and the engine's executor for it.

Cost is counted in multiply-adds (MACs) per layer, with k active heads of width d_h, n tokens, width D,
feed-forward width I:
    attention = 3·n·D·k·d_h (Q/K/V) + n·n·d_h·k (scores) + n·n·d_h·k (values) + n·k·d_h·D (output projection)
    FFN       = 2·n·D·I
plus the classifier D·C on the pooled vector. Embedding lookups, LayerNorms, softmax, GELU, biases and the
pooling sum are not multiply-adds of a weight matrix and are left out, as in the usual transformer FLOP counts.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from headbudget.models.budget import check_budget, head_mask, layer_head_orders
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

    @property
    def attention_ratio(self) -> float:
        """Fraction of the dense attention multiply-adds spent (the ``cost`` the service reports)."""
        return self.attention_macs / self.attention_macs_dense if self.attention_macs_dense else 0.0

    @property
    def attention_saved(self) -> int:
        return self.attention_macs_dense - self.attention_macs


def attention_macs(shape: Shape, heads: int, n_tokens: int) -> int:
    """MACs of one attention block running ``heads`` heads on ``n_tokens`` tokens."""
    n, d, w = n_tokens, shape.hidden, heads * shape.head_dim
    return 3 * n * d * w + 2 * n * n * w + n * w * d


def ffn_macs(shape: Shape, n_tokens: int) -> int:
    """MACs of one feed-forward block (two linear layers)."""
    return 2 * n_tokens * shape.hidden * shape.intermediate


@dataclass(frozen=True)
class ExecutionPlan:
    """What one forward pass runs: in layer l, the first ``heads[l]`` heads of that layer's head order."""

    heads: tuple[int, ...]
    n_heads: int  # heads per layer in the model

    @property
    def key(self) -> Hashable:
        """Requests whose plans have equal keys run the same computation, so they can share a batch."""
        return self.heads

    @property
    def heads_active(self) -> int:
        return sum(self.heads)

    @property
    def heads_total(self) -> int:
        return len(self.heads) * self.n_heads

    def cost(self, shape: Shape, n_tokens: int) -> Cost:
        """The plan's cost for one text of ``n_tokens`` tokens."""
        n_layers = len(self.heads)
        attn = sum(attention_macs(shape, k, n_tokens) for k in self.heads)
        attn_dense = n_layers * attention_macs(shape, shape.n_heads, n_tokens)
        rest = n_layers * ffn_macs(shape, n_tokens) + shape.hidden * shape.n_labels
        return Cost(heads_active=self.heads_active, heads_total=self.heads_total, attention_macs=attn,
                    attention_macs_dense=attn_dense, total_macs=attn + rest, total_macs_dense=attn_dense + rest)

    def flop_bound_speedup(self, shape: Shape, n_tokens: int) -> float:
        """The speedup over the dense forward pass if time were proportional to multiply-adds."""
        cost = self.cost(shape, n_tokens)
        return cost.total_macs_dense / cost.total_macs


def uniform_plan(cfg: ModelConfig, heads_per_layer: int) -> ExecutionPlan:
    """The same head count in every layer (the dense model, or an adaptive type's per-layer cap)."""
    return ExecutionPlan(heads=(heads_per_layer,) * cfg.n_layers, n_heads=cfg.n_heads)


class BudgetPolicy:
    """budget -> plan for a budgeted checkpoint: the hard mask of its head ranking, as per-layer prefixes."""

    def __init__(self, cfg: ModelConfig, order: np.ndarray) -> None:
        self.cfg = cfg
        self.order = order  # flat head ranking, (L*H,)
        self.perms = layer_head_orders(order, cfg.n_layers, cfg.n_heads)  # (L, H)

    def mask(self, budget: float) -> np.ndarray:
        """The hard mask, (L, H) bool."""
        c = self.cfg
        return head_mask(self.order, check_budget(budget), c.n_layers, c.n_heads, c.gate.structural)

    def plan(self, budget: float) -> ExecutionPlan:
        """The plan for ``budget``; the kept heads of each layer are the first ones of ``perms`` (checked)."""
        mask = self.mask(budget)
        counts = tuple(int(x) for x in mask.sum(axis=1))
        for layer, k in enumerate(counts):
            if not mask[layer, self.perms[layer, :k]].all():  # nestedness is what makes slices prefixes
                raise AssertionError(f"layer {layer}: kept heads are not a prefix of the head order")
        return ExecutionPlan(heads=counts, n_heads=self.cfg.n_heads)
