"""Adaptive attention span (docs/method.md §7.2), bidirectional: x = |t - r|.

Each head h has a span z_h = ratio_h * S (ratio in [0, 1], as the reference implementation parameterises
it, so one learning rate suits every S). Attention weights are m(x) exp(s) / sum m(x') exp(s') with the
ramp m(x) = clamp((R + z - x) / R, 0, 1). m is exactly 0 for x >= z + R, so a head never needs keys further
than ceil(z + R) - 1 tokens away: the engine truncates each head to that window and gets the same numbers.

The ramp, its log and the window are functions that this module and the engine's fast path
(engine/adaptive/model_types.py) both call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from headbudget.models.adaptive import AdaptiveAttention, AdaptiveClassifier, LayerOutput
from headbudget.models.config import ModelConfig


def span_window(z: float, ramp: int) -> int:
    """Keys a head can see on each side, itself included: ceil(z + R) (distances 0 .. window - 1)."""
    return max(1, int(math.ceil(z + ramp - 1e-9)))


def span_ramp(z: torch.Tensor, dist: torch.Tensor, ramp: float) -> torch.Tensor:
    """m_z(x) = clamp((R + z - x) / R, 0, 1) for spans z (H,) at distances x of any shape -> (H, *x.shape)."""
    z = z.reshape(-1, *([1] * dist.dim()))
    return ((ramp + z - dist.to(z.dtype)) / ramp).clamp(0.0, 1.0)


def log_ramp(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log m, added to the scores before the softmax; where m = 0, the most negative finite number of ``dtype``.

    Finite rather than -inf: a row with no visible key (a padding query) must not become NaN, which masked
    pooling cannot remove (0 * NaN = NaN).
    """
    return torch.where(m > 0, torch.log(m.clamp_min(1e-30)), torch.full_like(m, torch.finfo(dtype).min))


def side_macs(cfg: ModelConfig, n_tokens: int) -> int:
    """Multiply-adds of one layer's side network: none, the ramp is elementwise."""
    return 0


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
        return span_ramp(self.spans(), (pos[:, None] - pos[None, :]).abs(), self.ramp)

    def run(self, x: torch.Tensor, attn_bias: torch.Tensor, cap: float = 1.0, progress: float = 1.0) -> LayerOutput:
        """x (B, N, D), attn_bias (B, 1, 1, N); the spans are learned, not chosen per input: no cap applies."""
        b, n, _ = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))  # (B, H, N, dh)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + attn_bias  # (B, H, N, N)
        # log m adds the ramp before normalisation: m(x) exp(s) / sum m(x') exp(s').
        log_m = log_ramp(self.ramp_mask(n, x.device), x.dtype)[None]  # (1, H, N, N)
        logits = (scores + log_m).clamp_min(torch.finfo(x.dtype).min)
        attn = torch.softmax(logits, dim=-1)
        if self.training and self.attn_dropout:
            attn = F.dropout(attn, self.attn_dropout)
        y = attn @ v  # (B, H, N, dh)
        z = self.spans()  # (H,)
        # (lambda / M) * sum z over this layer's heads; averaging layers gives the sum over all M heads / M.
        aux = self.cfg.span.lambda_span * z.mean()
        return LayerOutput(self.output(y.transpose(1, 2).reshape(b, n, -1)), aux, {"span": z.detach().expand(b, -1)})


class SpanClassifier(AdaptiveClassifier):
    """The encoder classifier with adaptive-span attention in every layer."""

    attention_type = SpanAttention

    def span_layers(self) -> list[SpanAttention]:
        """The adaptive layers with their span type (the encoder holds them as plain modules)."""
        return [a for a in self.adaptive_layers() if isinstance(a, SpanAttention)]

    def windows(self) -> list[list[int]]:
        """Per layer, per head: the inference window ceil(z + R)."""
        return [[span_window(float(z), self.cfg.span.ramp) for z in a.spans().detach()] for a in self.span_layers()]
