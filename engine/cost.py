"""Exact multiply-add (MAC) accounting of one forward pass at a real sequence length.

Counted per layer with k active heads of width d_h, n tokens, width D, feed-forward width I:
    attention = 3·n·D·k·d_h (Q/K/V) + n·n·d_h·k (scores) + n·n·d_h·k (values) + n·k·d_h·D (output projection)
    FFN       = 2·n·D·I
plus the classifier D·C on the pooled vector. Embedding lookups, LayerNorms, softmax, GELU, biases and the
pooling sum are not multiply-adds of a weight matrix and are left out, as in the usual transformer FLOP counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from headbudget.engine.types import Cost
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


def attention_macs(shape: Shape, heads: int, n_tokens: int) -> int:
    """MACs of one attention block running ``heads`` heads on ``n_tokens`` tokens."""
    n, d, w = n_tokens, shape.hidden, heads * shape.head_dim
    return 3 * n * d * w + 2 * n * n * w + n * w * d


def ffn_macs(shape: Shape, n_tokens: int) -> int:
    """MACs of one feed-forward block (two linear layers)."""
    return 2 * n_tokens * shape.hidden * shape.intermediate


def forward_cost(shape: Shape, heads_per_layer: Sequence[int], n_tokens: int) -> Cost:
    """Cost of one text of ``n_tokens`` tokens when layer l runs ``heads_per_layer[l]`` heads."""
    n_layers = len(heads_per_layer)
    attn = sum(attention_macs(shape, k, n_tokens) for k in heads_per_layer)
    attn_dense = n_layers * attention_macs(shape, shape.n_heads, n_tokens)
    rest = n_layers * ffn_macs(shape, n_tokens) + shape.hidden * shape.n_labels
    return Cost(
        heads_active=int(sum(heads_per_layer)),
        heads_total=n_layers * shape.n_heads,
        attention_macs=attn,
        attention_macs_dense=attn_dense,
        total_macs=attn + rest,
        total_macs_dense=attn_dense + rest,
    )


def flop_bound_speedup(shape: Shape, heads_per_layer: Sequence[int], n_tokens: int) -> float:
    """The speedup over the dense forward pass if time were proportional to multiply-adds."""
    cost = forward_cost(shape, heads_per_layer, n_tokens)
    return cost.total_macs_dense / cost.total_macs
