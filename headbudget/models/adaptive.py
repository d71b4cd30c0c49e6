"""What the input-adaptive model types share: an attention base, what a forward pass returns, and a classifier
that swaps the attention in.

The adaptive attention modules keep the ``query/key/value/output`` names of ``GatedSelfAttention``, so the
pretrained loader, the dense warm-start stage and the checkpoint format work unchanged; their own
parameters sit beside those weights under ``encoder.layers.<i>.attention.``.

A forward pass returns everything it computed (``AdaptiveOutput``: logits, regulariser, per-input usage); the
cap and the training progress are arguments of that pass, not state left on the modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headbudget.models.attention import GatedSelfAttention
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import ModelConfig


def real_tokens(attn_bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The padding mask back from the additive bias (B, 1, 1, N): 1.0 for real tokens, 0.0 for padding; (B, N)."""
    return (attn_bias[:, 0, 0, :] == 0).to(dtype)


def masked_mean(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens: x (B, N, F), real (B, N) -> (B, F)."""
    return (x * real[:, :, None]).sum(1) / real.sum(1, keepdim=True).clamp_min(1.0)


@dataclass(frozen=True)
class LayerOutput:
    """One adaptive attention layer's forward pass."""

    y: torch.Tensor  # (B, N, D), the attention output
    aux_loss: torch.Tensor  # scalar: this layer's regulariser
    usage: dict[str, torch.Tensor]  # name -> (B, ...), what each input used (detached)


@dataclass(frozen=True)
class AdaptiveOutput:
    """An adaptive classifier's forward pass."""

    logits: torch.Tensor  # (B, C)
    aux_loss: torch.Tensor  # scalar: the mean over layers of each layer's regulariser
    usage: dict[str, torch.Tensor]  # name -> (B, L, ...), per input, stacked over layers


class AdaptiveAttention(GatedSelfAttention):
    """Base of the adaptive heads: ``run`` is the forward pass of docs/method.md §7, under a cap and at a progress."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.cfg = cfg

    def run(self, x: torch.Tensor, attn_bias: torch.Tensor, cap: float = 1.0, progress: float = 1.0) -> LayerOutput:
        """x (B, N, D), attn_bias (B, 1, 1, N); ``cap`` a budget bounding each input's choice (1.0 = none),
        ``progress`` t / T for the training schedules (1.0: inference behaves like the end of training)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, head_gate: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, N, D) -> (B, N, D) as served (no cap, progress 1.0); ``head_gate`` is ignored: the layer chooses."""
        return self.run(x, attn_bias).y


class AdaptiveClassifier(BudgetedClassifier):
    """A BudgetedClassifier whose layers use ``attention_type``; the (unused) budget gates stay for one format."""

    attention_type: type[AdaptiveAttention] = AdaptiveAttention

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        for layer in self.encoder.layers:
            layer.attention = self.attention_type(cfg)

    def adaptive_layers(self) -> list[AdaptiveAttention]:
        """Every layer's adaptive attention module, in order."""
        return [layer.attention for layer in self.encoder.layers]  # type: ignore[misc]

    def adaptive_parameters(self) -> list[nn.Parameter]:
        """Parameters the adaptive method adds (its own learning rate in training)."""
        base = set(GatedSelfAttention(self.cfg).state_dict())
        return [p for a in self.adaptive_layers() for n, p in a.named_parameters() if n not in base]

    def forward_adaptive(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cap: float = 1.0,
                         progress: float = 1.0) -> AdaptiveOutput:
        """input_ids, attention_mask (B, N) -> logits, regulariser and usage; ``cap`` a budget that bounds each
        input's choice (BudgetFormer: round(cap * H) heads per layer; 1.0 = the model's own choice, ``auto``),
        ``progress`` t / T in [0, 1] for the schedules of docs/method.md §7."""
        x = self.encoder.embeddings(input_ids)  # (B, N, D)
        # The encoder's additive bias: 0 for real tokens, a large negative number for padding; (B, 1, 1, N).
        attn_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        aux, usage = [], []
        for layer in self.encoder.layers:
            attention = layer.attention
            assert isinstance(attention, AdaptiveAttention)
            out = attention.run(x, attn_bias, cap, progress)
            # EncoderLayer.forward after its attention (the layer's own forward cannot hand back aux and usage).
            x = layer.attn_norm(x + layer.dropout(out.y))
            x = layer.ffn_norm(x + layer.dropout(layer.ffn_out(F.gelu(layer.intermediate(x)))))
            aux.append(out.aux_loss)
            usage.append(out.usage)
        stacked = {k: torch.stack([u[k] for u in usage], dim=1) for k in usage[0]}
        return AdaptiveOutput(self.head(self.pool(x, attention_mask)), torch.stack(aux).mean(), stacked)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head_gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, C) as served: no cap, progress 1.0; ``head_gate`` is ignored (the model chooses)."""
        return self.forward_adaptive(input_ids, attention_mask).logits
