"""Multi-head self-attention whose heads are scaled by per-example gates before the output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headbudget.models.config import ModelConfig


class GatedSelfAttention(nn.Module):
    """BERT self-attention plus output projection; ``head_gate`` (B, H) weighs each head's output.

    A gate of exactly 0 makes the head contribute exactly zero (0 * finite = 0), which is how the reference
    model expresses a hard mask; the engine gets the same numbers by not computing the head at all.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.output = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn_dropout = cfg.dropout

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, dh)

    def forward(
        self, x: torch.Tensor, attn_bias: torch.Tensor, head_gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, N, D), attn_bias (B, 1, 1, N) additive, head_gate (B, H) or None -> (B, N, D)."""
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=p)  # (B, H, N, dh)
        if head_gate is not None:
            y = y * head_gate.to(y.dtype)[:, :, None, None]
        b, _, n, _ = y.shape
        return self.output(y.transpose(1, 2).reshape(b, n, -1))
