"""BudgetFormer (METHODS.md section 2): each input picks how many heads, and which, per layer.

Training runs every head, weighted w_h = s * H * p_h; inference keeps the top k = max(1, floor(s * H)) heads
of p (capped by a requested budget, k = min(k_pred, k_cap)) and the others are not computed by the engine.
Kept heads keep their weight w_h, so that inference is the training-time function with the unchosen heads
removed, not a differently scaled one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from headbudget.models.adaptive import AdaptiveAttention, AdaptiveClassifier, masked_mean, real_tokens
from headbudget.models.config import ModelConfig


def budget_cap_heads(budget: float, n_heads: int) -> int:
    """k_cap per layer for a requested budget: round(b * H), at least 1 (halves round up, as n_kept does)."""
    return max(1, min(n_heads, int(math.floor(budget * n_heads + 0.5 + 1e-9))))


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
        self.cap_heads = cfg.n_heads  # k_cap from a requested budget; H = no cap

    def tau(self) -> float:
        """tau(t) = tau_min + (tau_max - tau_min) * exp(-gamma * t / T)."""
        bf = self.cfg.budgetformer
        return bf.tau_min + (bf.tau_max - bf.tau_min) * math.exp(-bf.gamma * self.progress)

    def head_weights(self, x: torch.Tensor, attn_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, N, D) -> (s (B,), p (B, H)) from the mean of the layer input over real tokens."""
        h = masked_mean(x, real_tokens(attn_bias, x.dtype))  # (B, D)
        s = torch.sigmoid(self.budget_out(F.relu(self.budget_hidden(h)))).squeeze(-1)  # (B,)
        z = self.relevance(h)  # (B, H)
        if self.training:
            z = z + torch.randn_like(z) * self.cfg.budgetformer.sigma_max * (1.0 - self.progress)
        return s, torch.softmax(z / self.tau(), dim=-1)

    def keep(self, s: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Inference head choice: bool (B, H), the top-k of p with k = min(max(1, floor(s H)), k_cap)."""
        n_heads = p.shape[-1]
        k = torch.clamp(torch.floor(s * n_heads), 1, n_heads).clamp_max(self.cap_heads).long()  # (B,)
        # Stable sort: equal relevances fall back to head order, so the choice is deterministic.
        order = torch.argsort(p, dim=-1, descending=True, stable=True)  # (B, H)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(n_heads, device=p.device).expand_as(order))
        return rank < k[:, None]

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, head_gate: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, N, D) -> (B, N, D); ``head_gate`` is ignored (the model chooses its own heads)."""
        s, p = self.head_weights(x, attn_bias)
        w = s[:, None] * p.shape[-1] * p  # (B, H)
        if not self.training:
            kept = self.keep(s, p)
            w = w * kept.to(w.dtype)
            self.stats = {"s": s.detach(), "heads": kept.sum(-1).detach()}
        else:
            self.stats = {"s": s.detach(), "heads": torch.floor(s.detach() * p.shape[-1]).clamp_min(1)}
        self._s, self._p = s, p
        return super().forward(x, attn_bias, w)

    def aux_loss(self) -> torch.Tensor:
        """alpha(s) * v(s)^2 + beta(t) * sum_h p_h log p_h, averaged over the batch."""
        bf, s, p = self.cfg.budgetformer, self._s, self._p
        v = F.relu(bf.s_min - s) + F.relu(s - bf.s_max)  # (B,)
        alpha = torch.clamp(bf.alpha_base + v.detach(), max=bf.alpha_max)  # a coefficient, not a target
        beta = bf.beta_max * (2.0 * self.progress - 1.0)
        neg_entropy = (p * torch.log(p.clamp_min(1e-12))).sum(-1)  # (B,)
        return (alpha * v**2 + beta * neg_entropy).mean()


class BudgetFormerClassifier(AdaptiveClassifier):
    """The encoder classifier with BudgetFormer attention in every layer."""

    attention_type = BudgetFormerAttention

    def set_budget_cap(self, budget: float) -> None:
        """Cap every layer at k_cap = round(b * H) heads (1.0 = the model's own choice, ``budget=auto``)."""
        k = budget_cap_heads(budget, self.cfg.n_heads)
        for a in self.adaptive_layers():
            if isinstance(a, BudgetFormerAttention):
                a.cap_heads = k
