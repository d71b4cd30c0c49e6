"""Each adaptive type's part of the fast path (engine/adaptive/backend.py): its cap, how its heads are laid
out, the plan each input runs in each layer, and what its side network costs.

The math is in models/ (budgetformer, span, adaattention: the same functions the reference modules call); a
type here only turns it into plans, groups of heads at a width and a span window that the backend executes.
``type_path`` looks the type up once, when the engine loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headbudget.engine.types import Cost
from headbudget.models import adaattention, budgetformer, span
from headbudget.models.adaptive import AdaptiveAttention
from headbudget.models.config import ModelConfig
from headbudget.models.model_types import model_type

FULL = 1 << 30  # a span window no sequence reaches: every key, with the ramp
Group = tuple[tuple[int, ...], int, int]  # (heads, width d', span window; 0 = every key, no ramp)
Plan = tuple[Group, ...]  # one layer's heads for one input, in projection order
Weights = list[torch.Tensor | None]  # per input: its kept heads' output weights (k,), or None (weight 1)


def segment_mean(x: torch.Tensor, seg: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-input mean of packed rows: x (T, F), seg (T,) -> (B, F)."""
    sums = x.new_zeros(len(lengths), x.shape[1]).index_add_(0, seg, x)
    return sums / torch.tensor(lengths, dtype=x.dtype)[:, None]


@dataclass(frozen=True)
class Layout:
    """How one layer's heads are laid out for the fast path."""

    perm: list[int]  # the heads in projection order
    plan: Plan | None = None  # the plan every input runs, where the type fixes one (span: heads grouped by window)
    span_z: torch.Tensor | None = None  # (H,) span z per head in ``perm`` order (span only)
    span_log_m: torch.Tensor | None = None  # (H, max_position): the ramp's log m at each distance (span only)


class TypePath:
    """One adaptive type on the fast path. ``choose`` gets one layer's packed input x (T, D), each token's input
    ``seg`` (T,) and the inputs' ``lengths``; ``adaptive=False`` plans every head, key and dimension (the
    benchmark's dense baseline, same code)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.every_head: Plan = ((tuple(range(cfg.n_heads)), cfg.head_dim, 0),)

    def cap_heads(self, budget: float) -> int:
        """Heads per layer an input may run at ``budget``: every head (the budget bounds no choice)."""
        return self.cfg.n_heads

    def layout(self, attn: AdaptiveAttention) -> Layout:
        """The layer's heads in their own order."""
        return Layout(list(range(self.cfg.n_heads)))

    def choose(self, attn: AdaptiveAttention, layout: Layout, x: torch.Tensor, seg: torch.Tensor, lengths: list[int],
               cap: int, adaptive: bool) -> tuple[list[Plan], Weights]:
        """Each input's plan for this layer and its heads' weights."""
        raise NotImplementedError

    def side_macs(self, n_tokens: int) -> int:
        """Multiply-adds of one layer's side network for one input of ``n_tokens`` tokens."""
        raise NotImplementedError

    def budget_chosen(self, cost: Cost) -> float | None:
        """The budget an input chose for itself, for a type that chooses one; None for the others."""
        return None


class BudgetFormerPath(TypePath):
    """Per input and layer, s and p from the mean layer input; the top-k heads of p, k capped by the budget."""

    def cap_heads(self, budget: float) -> int:
        """k_cap per layer: round(budget * H) (1.0 = H = no cap)."""
        return budgetformer.budget_cap_heads(budget, self.cfg.n_heads)

    def choose(self, attn: AdaptiveAttention, layout: Layout, x: torch.Tensor, seg: torch.Tensor, lengths: list[int],
               cap: int, adaptive: bool) -> tuple[list[Plan], Weights]:
        """The kept heads of each input and their training-time weights w_h (eval, progress 1.0)."""
        assert isinstance(attn, budgetformer.BudgetFormerAttention)
        s, p = attn.budget_and_relevance(segment_mean(x, seg, lengths), progress=1.0)  # (B,), (B, H)
        w = budgetformer.head_weights(s, p)  # (B, H)
        if not adaptive:
            return [self.every_head] * len(lengths), [row for row in w]
        plans: list[Plan] = []
        weights: Weights = []
        for i, row in enumerate(budgetformer.keep_heads(s, p, cap).tolist()):  # (B, H) bool
            kept = tuple(h for h, keep in enumerate(row) if keep)
            plans.append(((kept, self.cfg.head_dim, 0),))
            weights.append(w[i, list(kept)])  # (k,)
        return plans, weights

    def side_macs(self, n_tokens: int) -> int:
        return budgetformer.side_macs(self.cfg, n_tokens)

    def budget_chosen(self, cost: Cost) -> float | None:
        """The fraction of heads the input ran: its predicted budget, within the cap."""
        return cost.heads_active / cost.heads_total


class SpanPath(TypePath):
    """Every head, each over its window ceil(z + R); heads sorted by window so equal windows run as one group."""

    def layout(self, attn: AdaptiveAttention) -> Layout:
        """Heads sorted by window, the layer's one plan, and the ramp's log m as a table over distances."""
        assert isinstance(attn, span.SpanAttention)
        ramp = self.cfg.span.ramp
        wins = [span.span_window(float(z), ramp) for z in attn.spans().tolist()]
        perm = sorted(range(len(wins)), key=lambda h: wins[h])
        plan = tuple((tuple(i for i in range(len(wins)) if wins[perm[i]] == w), self.cfg.head_dim, w)
                     for w in sorted(set(wins)))
        z = attn.spans()[torch.tensor(perm)].contiguous()  # (H,)
        m = span.span_ramp(z, torch.arange(self.cfg.max_position), float(ramp))  # (H, max_position)
        return Layout(perm, plan, z, span.log_ramp(m, m.dtype))

    def choose(self, attn: AdaptiveAttention, layout: Layout, x: torch.Tensor, seg: torch.Tensor, lengths: list[int],
               cap: int, adaptive: bool) -> tuple[list[Plan], Weights]:
        """The layer's plan for every input (spans are learned, not chosen per input)."""
        assert layout.plan is not None
        dense: Plan = ((tuple(range(self.cfg.n_heads)), self.cfg.head_dim, FULL),)
        return [layout.plan if adaptive else dense] * len(lengths), [None] * len(lengths)

    def side_macs(self, n_tokens: int) -> int:
        return span.side_macs(self.cfg, n_tokens)


class AdaAttentionPath(TypePath):
    """Per input, each head's d' from the mean scorer output; heads of one width run as one group."""

    def choose(self, attn: AdaptiveAttention, layout: Layout, x: torch.Tensor, seg: torch.Tensor, lengths: list[int],
               cap: int, adaptive: bool) -> tuple[list[Plan], Weights]:
        """Each input's heads grouped by their reduced dimension."""
        if not adaptive:
            return [self.every_head] * len(lengths), [None] * len(lengths)
        assert isinstance(attn, adaattention.AdaAttention)
        score = segment_mean(attn.token_scores(x), seg, lengths)  # (B, H)
        dims = adaattention.reduced_dims(score, self.cfg.head_dim, self.cfg.ada.threshold).tolist()  # (B, H)
        heads = range(self.cfg.n_heads)
        plans = [tuple((tuple(h for h in heads if row[h] == w), w, 0) for w in sorted(set(row))) for row in dims]
        return plans, [None] * len(lengths)

    def side_macs(self, n_tokens: int) -> int:
        return adaattention.side_macs(self.cfg, n_tokens)


# One entry per adaptive type of models/model_types.py (tests/engine/test_adaptive.py checks that they match).
PATHS: dict[str, type[TypePath]] = {"budgetformer": BudgetFormerPath, "span": SpanPath,
                                    "adaattention": AdaAttentionPath}


def type_path(cfg: ModelConfig) -> TypePath | None:
    """The fast path of ``cfg.model_type``; None for a type with static plans (not adaptive)."""
    return None if model_type(cfg.model_type).static_plans else PATHS[cfg.model_type](cfg)
