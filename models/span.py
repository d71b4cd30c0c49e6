"""Adaptive attention span (METHODS.md section 3), bidirectional: x = |t - r|.

Each head h has a span z_h = ratio_h * S (ratio in [0, 1], as the reference implementation parameterises
it, so one learning rate suits every S). Attention weights are m(x) exp(s) / sum m(x') exp(s') with the
ramp m(x) = clamp((R + z - x) / R, 0, 1). m is exactly 0 for x >= z + R, so a head never needs keys further
than ceil(z + R) - 1 tokens away: the engine truncates each head to that window and gets the same numbers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from headbudget.models.adaptive import AdaptiveAttention, AdaptiveClassifier
from headbudget.models.config import ModelConfig


def span_window(z: float, ramp: int) -> int:
    """Keys a head can see on each side, itself included: ceil(z + R) (distances 0 .. window - 1)."""
    return max(1, int(math.ceil(z + ramp - 1e-9)))


class SpanAttention(AdaptiveAttention):
    """Self-attention whose heads each learn how far they look."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.max_span = float(cfg.span.max_span or cfg.max_position)
        self.ramp = float(cfg.span.ramp)
        self.span_ratio = nn.Parameter(torch.full((cfg.n_heads,), float(cfg.span.init_ratio)))

    def spans(self) -> torch.Tensor:
        """z per head in tokens, (H,)."""
        return self.span_ratio.clamp(0.0, 1.0) * self.max_span

    def ramp_mask(self, n: int, device: torch.device) -> torch.Tensor:
        """m_z(|t - r|) for every head, (H, N, N)."""
        pos = torch.arange(n, device=device)
        dist = (pos[:, None] - pos[None, :]).abs().to(self.span_ratio.dtype)  # (N, N)
        return ((self.ramp + self.spans()[:, None, None] - dist) / self.ramp).clamp(0.0, 1.0)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, head_gate: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, N, D), attn_bias (B, 1, 1, N) -> (B, N, D)."""
        b, n, _ = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))  # (B, H, N, dh)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + attn_bias  # (B, H, N, N)
        m = self.ramp_mask(n, x.device)[None]  # (1, H, N, N)
        # log m adds the ramp before normalisation; clamp keeps rows with no visible key (padding queries)
        # finite, where -inf would give NaN that masked pooling cannot remove (0 * NaN = NaN).
        log_m = torch.where(m > 0, torch.log(m.clamp_min(1e-30)), torch.full_like(m, torch.finfo(x.dtype).min))
        logits = (scores + log_m).clamp_min(torch.finfo(x.dtype).min)
        attn = torch.softmax(logits, dim=-1)
        if self.training and self.attn_dropout:
            attn = F.dropout(attn, self.attn_dropout)
        y = attn @ v  # (B, H, N, dh)
        self.stats = {"span": self.spans().detach().expand(b, -1)}
        return self.output(y.transpose(1, 2).reshape(b, n, -1))

    def aux_loss(self) -> torch.Tensor:
        """(lambda / M) * sum z over this layer's heads; averaging layers gives the sum over all M heads / M."""
        return self.cfg.span.lambda_span * self.spans().mean()


class SpanClassifier(AdaptiveClassifier):
    """The encoder classifier with adaptive-span attention in every layer."""

    attention_type = SpanAttention

    def span_layers(self) -> list[SpanAttention]:
        """The adaptive layers with their span type (the encoder holds them as plain modules)."""
        return [a for a in self.adaptive_layers() if isinstance(a, SpanAttention)]

    def windows(self) -> list[list[int]]:
        """Per layer, per head: the inference window ceil(z + R)."""
        return [[span_window(float(z), self.cfg.span.ramp) for z in a.spans().detach()] for a in self.span_layers()]
