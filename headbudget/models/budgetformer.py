"""BudgetFormer (docs/method.md §7.1): each input picks how many heads, and which, per layer.

Training runs every head, weighted w_h = s * H * p_h; inference keeps the top k = max(1, floor(s * H)) heads
of p (capped by a requested budget, k = min(k_pred, k_cap)) and the others are not computed by the engine.
Kept heads keep their weight w_h, so that inference is the training-time function with the unchosen heads
removed, not a differently scaled one.

The math is in functions (temperature, head weights, the keep rule, the regulariser, the side network's
multiply-adds) that this module and the engine's fast path (engine/adaptive/model_types.py) both call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from headbudget.models.adaptive import (
    AdaptiveAttention,
    AdaptiveClassifier,
    LayerOutput,
    masked_mean,
    real_tokens,
)
from headbudget.models.attention import GatedSelfAttention
from headbudget.models.config import BudgetFormerConfig, ModelConfig


def budget_cap_heads(budget: float, n_heads: int) -> int:
    """k_cap per layer for a requested budget: round(b * H), at least 1 (halves round up, as n_kept does)."""
    return max(1, min(n_heads, int(math.floor(budget * n_heads + 0.5 + 1e-9))))


def temperature(cfg: BudgetFormerConfig, progress: float) -> float:
    """tau(t) = tau_min + (tau_max - tau_min) * exp(-gamma * t / T), at progress t / T."""
    return cfg.tau_min + (cfg.tau_max - cfg.tau_min) * math.exp(-cfg.gamma * progress)


def head_weights(s: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The training-time head weights w_h = s * H * p_h: s (B,), p (B, H) -> (B, H)."""
    return s[:, None] * p.shape[-1] * p


def keep_heads(s: torch.Tensor, p: torch.Tensor, cap_heads: int) -> torch.Tensor:
    """Inference head choice: bool (B, H), the top-k of p with k = min(max(1, floor(s H)), k_cap)."""
    n_heads = p.shape[-1]
    k = torch.clamp(torch.floor(s * n_heads), 1, n_heads).clamp_max(cap_heads).long()  # (B,)
    # Stable sort: equal relevances fall back to head order, so the choice is deterministic.
    order = torch.argsort(p, dim=-1, descending=True, stable=True)  # (B, H)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n_heads, device=p.device).expand_as(order))
    return rank < k[:, None]


def regulariser(cfg: BudgetFormerConfig, s: torch.Tensor, p: torch.Tensor, progress: float) -> torch.Tensor:
    """alpha(s) * v(s)^2 + beta(t) * sum_h p_h log p_h, averaged over the batch: s (B,), p (B, H) -> scalar."""
    v = F.relu(cfg.s_min - s) + F.relu(s - cfg.s_max)  # (B,)
    alpha = torch.clamp(cfg.alpha_base + v.detach(), max=cfg.alpha_max)  # a coefficient, not a target
    beta = cfg.beta_max * (2.0 * progress - 1.0)
    neg_entropy = (p * torch.log(p.clamp_min(1e-12))).sum(-1)  # (B,)
    return (alpha * v**2 + beta * neg_entropy).mean()


def side_macs(cfg: ModelConfig, n_tokens: int) -> int:
    """Multiply-adds of one layer's f (D -> D -> 1) and g (D -> H) for one input: once, on its mean token."""
    d = cfg.hidden_size
    return d * d + d + d * cfg.n_heads


class BudgetFormerAttention(AdaptiveAttention):
    """Self-attention with a per-input budget network f and head-relevance network g."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d, bf = cfg.hidden_size, cfg.budgetformer
        self.budget_hidden = nn.Linear(d, d)  # f: D -> D -> 1, ReLU between
        self.budget_out = nn.Linear(d, 1)
        self.relevance = nn.Linear(d, cfg.n_heads)  # g: D -> H
        nn.init.zeros_(self.budget_out.weight)
        nn.init.constant_(self.budget_out.bias, math.log(bf.init_s / (1.0 - bf.init_s)))
        nn.init.zeros_(self.relevance.weight)  # p starts uniform; the noise breaks the tie while training
        nn.init.zeros_(self.relevance.bias)

    def budget_and_relevance(self, h: torch.Tensor, progress: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean layer inputs h (B, D) -> (s (B,), p (B, H)); p's logits get the schedule's noise while training."""
        s = torch.sigmoid(self.budget_out(F.relu(self.budget_hidden(h)))).squeeze(-1)  # (B,)
        z = self.relevance(h)  # (B, H)
        bf = self.cfg.budgetformer
        if self.training:
            z = z + torch.randn_like(z) * bf.sigma_max * (1.0 - progress)
        return s, torch.softmax(z / temperature(bf, progress), dim=-1)

    def run(self, x: torch.Tensor, attn_bias: torch.Tensor, cap: float = 1.0, progress: float = 1.0) -> LayerOutput:
        """x (B, N, D): every head weighted by w while training; at inference the kept heads only, under ``cap``."""
        s, p = self.budget_and_relevance(masked_mean(x, real_tokens(attn_bias, x.dtype)), progress)
        w = head_weights(s, p)  # (B, H)
        if self.training:
            heads = torch.floor(s.detach() * p.shape[-1]).clamp_min(1)  # (B,) what inference would keep, uncapped
        else:
            kept = keep_heads(s, p, budget_cap_heads(cap, p.shape[-1]))  # (B, H)
            w = w * kept.to(w.dtype)
            heads = kept.sum(-1)
        # The gated attention of the base class (this class's own forward is the served pass, which calls run).
        y = GatedSelfAttention.forward(self, x, attn_bias, w)
        usage = {"s": s.detach(), "heads": heads.detach()}
        return LayerOutput(y, regulariser(self.cfg.budgetformer, s, p, progress), usage)


class BudgetFormerClassifier(AdaptiveClassifier):
    """The encoder classifier with BudgetFormer attention in every layer."""

    attention_type = BudgetFormerAttention
