"""What the input-adaptive model types share: an attention base and a classifier that swaps it in.

The adaptive attention modules keep the ``query/key/value/output`` names of ``GatedSelfAttention``, so the
pretrained loader, the dense warm-start stage and the checkpoint format work unchanged; their own
parameters sit beside those weights under ``encoder.layers.<i>.attention.``.
"""

from __future__ import annotations

import torch
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


class AdaptiveAttention(GatedSelfAttention):
    """Base of the adaptive heads: ``progress`` (t / T) drives schedules; ``stats`` holds the last forward's usage."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.cfg = cfg
        self.progress = 1.0  # inference behaves like the end of training
        self.stats: dict[str, torch.Tensor] = {}

    def aux_loss(self) -> torch.Tensor:
        """This layer's regulariser for the last forward pass (a scalar)."""
        raise NotImplementedError


class AdaptiveClassifier(BudgetedClassifier):
    """A BudgetedClassifier whose layers use ``attention_type``; the (unused) budget gates stay for one format."""

    attention_type: type[AdaptiveAttention] = AdaptiveAttention

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        for layer in self.encoder.layers:
            layer.attention = self.attention_type(cfg)

    def adaptive_layers(self) -> list[AdaptiveAttention]:
        return [layer.attention for layer in self.encoder.layers]  # type: ignore[misc]

    def adaptive_parameters(self) -> list[nn.Parameter]:
        """Parameters the adaptive method adds (its own learning rate in training)."""
        base = set(GatedSelfAttention(self.cfg).state_dict())
        return [p for a in self.adaptive_layers() for n, p in a.named_parameters() if n not in base]

    def set_progress(self, progress: float) -> None:
        """Training progress t / T in [0, 1] for the schedules of METHODS.md."""
        for a in self.adaptive_layers():
            a.progress = float(progress)

    def aux_loss(self) -> torch.Tensor:
        """Mean over layers of each layer's regulariser, for the last forward pass."""
        return torch.stack([a.aux_loss() for a in self.adaptive_layers()]).mean()

    def usage(self) -> dict[str, torch.Tensor]:
        """Per-input usage of the last forward pass, stacked over layers: name -> (B, L, ...)."""
        layers = [a.stats for a in self.adaptive_layers()]
        return {k: torch.stack([s[k] for s in layers], dim=1) for k in layers[0]} if layers[0] else {}
