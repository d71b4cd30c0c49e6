"""Complexity-scored reduced attention, AdaAttention (docs/method.md §7.3).

A scorer MLP (D -> D/4 -> D/4 -> H, ReLU) gives each token a score per head; a head whose mean score over the
input's real tokens is above the threshold runs at full head dimension, otherwise at d' = max(1, floor(d_h *
mean score)) dimensions: its query and value keep their first d' dimensions (the score q.k and the head's
output then only involve those), so the engine can slice W_q, W_k, W_v and W_o to d' and compute nothing else.
Training uses that hard choice forward and a straight-through ramp backward (dimension j weighs
clamp(d_h * c - j, 0, 1)), so the trained function is exactly what inference runs.

The math is in functions (the reduced dimensions, the dimension mask, lambda(t), the scorer's multiply-adds)
that this module and the engine's fast path (engine/adaptive/model_types.py) both call.
"""

from __future__ import annotations

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
from headbudget.models.config import AdaConfig, ModelConfig


def ada_lambda(cfg: AdaConfig, progress: float) -> float:
    """lambda(t): 0 for the first 10% of training, then lambda_mid, rising linearly to lambda_end over the last 5%."""
    if progress < cfg.off_fraction:
        return 0.0
    start = 1.0 - cfg.ramp_fraction
    if progress <= start:
        return cfg.lambda_mid
    return cfg.lambda_mid + (cfg.lambda_end - cfg.lambda_mid) * min(1.0, (progress - start) / cfg.ramp_fraction)


def reduced_dims(score: torch.Tensor, head_dim: int, threshold: float) -> torch.Tensor:
    """Dimensions each head runs at from its mean score (..., H) -> long (..., H): d_h or max(1, floor(d_h c))."""
    reduced = torch.floor(score * head_dim).clamp(1, head_dim).long()
    return torch.where(score > threshold, torch.full_like(reduced, head_dim), reduced)


def dim_mask(score: torch.Tensor, head_dim: int, threshold: float, straight_through: bool) -> torch.Tensor:
    """Per-dimension weights (B, H, dh) from mean scores (B, H): the hard choice forward, and with
    ``straight_through`` (training) the ramp clamp(d_h c - j, 0, 1)'s gradient backward."""
    j = torch.arange(head_dim, device=score.device, dtype=score.dtype)  # (dh,)
    dims = reduced_dims(score, head_dim, threshold)  # (B, H)
    hard = (j[None, None, :] < dims[:, :, None]).to(score.dtype)
    if not straight_through:
        return hard
    soft = (score[:, :, None] * head_dim - j[None, None, :]).clamp(0.0, 1.0)
    return hard + (soft - soft.detach())


def side_macs(cfg: ModelConfig, n_tokens: int) -> int:
    """Multiply-adds of one layer's scorer (D -> D/4 -> D/4 -> H) for one input: on every token."""
    d, q = cfg.hidden_size, cfg.hidden_size // 4
    return n_tokens * (d * q + q * q + q * cfg.n_heads)


class AdaAttention(AdaptiveAttention):
    """Self-attention whose heads shrink to a reduced dimension on inputs the scorer finds simple."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        self.scorer = nn.Sequential(nn.Linear(d, d // 4), nn.ReLU(), nn.Linear(d // 4, d // 4), nn.ReLU(),
                                    nn.Linear(d // 4, cfg.n_heads))
        last = self.scorer[-1]
        assert isinstance(last, nn.Linear)
        nn.init.normal_(last.weight, std=0.01)
        nn.init.constant_(last.bias, cfg.ada.init_bias)

    def token_scores(self, x: torch.Tensor) -> torch.Tensor:
        """Complexity score per token and head, in (0, 1): x (..., D) -> (..., H)."""
        return torch.sigmoid(self.scorer(x))

    def mean_scores(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        """Mean complexity score per head over real tokens: x (B, N, D) -> (B, H)."""
        return masked_mean(self.token_scores(x), real_tokens(attn_bias, x.dtype))

    def run(self, x: torch.Tensor, attn_bias: torch.Tensor, cap: float = 1.0, progress: float = 1.0) -> LayerOutput:
        """x (B, N, D), attn_bias (B, 1, 1, N); the scorer, not a budget, chooses the dimensions: no cap applies."""
        b, n, _ = x.shape
        threshold = self.cfg.ada.threshold
        score = self.mean_scores(x, attn_bias)  # (B, H)
        m = dim_mask(score, self.head_dim, threshold, self.training)[:, :, None, :]  # (B, H, 1, dh)
        q = self._split(self.query(x)) * m
        k = self._split(self.key(x))
        v = self._split(self.value(x)) * m
        p = self.attn_dropout if self.training else 0.0
        # The scale stays 1/sqrt(d_h) at every d': training masks dimensions, it does not rescale them.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=p)  # (B, H, N, dh)
        usage = {"score": score.detach(), "dims": reduced_dims(score.detach(), self.head_dim, threshold)}
        aux = ada_lambda(self.cfg.ada, progress) * score.mean()  # lambda(t) * mean score
        return LayerOutput(self.output(y.transpose(1, 2).reshape(b, n, -1)), aux, usage)


class AdaAttentionClassifier(AdaptiveClassifier):
    """The encoder classifier with complexity-scored attention in every layer."""

    attention_type = AdaAttention
