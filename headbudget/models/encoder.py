"""Post-LN BERT encoder (embeddings + layers) whose attention heads take gates."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headbudget.models.attention import GatedSelfAttention
from headbudget.models.config import ModelConfig


class Embeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, N) -> (B, N, D)."""
        n = input_ids.shape[1]
        pos = torch.arange(n, device=input_ids.device)
        x = self.word(input_ids) + self.position(pos)[None] + self.token_type.weight[0]
        return self.dropout(self.norm(x))


class EncoderLayer(nn.Module):
    """Gated attention and feed-forward block, each with a residual and a LayerNorm after it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.ffn_group = cfg.n_heads, cfg.gate.ffn_group
        self.attention = GatedSelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, attn_bias: torch.Tensor, gate: torch.Tensor | None
    ) -> torch.Tensor:
        """x (B, N, D), gate (B, U) or None -> (B, N, D); units: the heads, then any feed-forward groups."""
        head_gate = None if gate is None else gate[:, : self.n_heads]
        x = self.attn_norm(x + self.dropout(self.attention(x, attn_bias, head_gate)))
        # Exact (erf) GELU, as BERT and MiniLM use.
        h = F.gelu(self.intermediate(x))  # (B, N, I)
        if gate is not None and gate.shape[1] > self.n_heads:
            # A group's gate scales its neurons before the second matrix: a gate of exactly 0 removes the group's
            # columns of W2 from the sum, which is what the engine gets by not computing them.
            neuron_gate = gate[:, self.n_heads:].repeat_interleave(self.ffn_group, dim=1)  # (B, I)
            h = h * neuron_gate.to(h.dtype)[:, None, :]
        return self.ffn_norm(x + self.dropout(self.ffn_out(h)))


class Encoder(nn.Module):
    """Embeddings followed by ``n_layers`` gated layers."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head_gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids, attention_mask (B, N); head_gate (B, L, U) or None -> hidden states (B, N, D)."""
        return self.layer_states(input_ids, attention_mask, head_gate)[-1]

    def layer_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head_gate: torch.Tensor | None = None,
        depth: int | None = None,
    ) -> list[torch.Tensor]:
        """The first ``depth`` (all: None) layers' outputs, tensors (B, N, D): what hidden-state distillation
        compares and what exits read."""
        x = self.embeddings(input_ids)
        # Additive bias: 0 for real tokens, a large negative number for padding; (B, 1, 1, N).
        attn_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        states = []
        for i, layer in enumerate(self.layers[:depth]):
            x = layer(x, attn_bias, None if head_gate is None else head_gate[:, i])
            states.append(x)
        return states
