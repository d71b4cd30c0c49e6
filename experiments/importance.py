"""Head importance (METHODS.md section 4, Michel et al. 2019) and the masking-ablation score.

Gradient importance: attach a mask variable xi_h = 1 to every head (the classifier's ``head_gate``, which
multiplies each head's output before W_O) and take I_h = E_x |dL(x)/d xi_h|. The definition has the
absolute value *inside* the expectation, so we give every example its own xi (head_gate of shape (B, L, H)
requiring grad): one backward pass of the summed loss then yields every example's own gradient, because an
example's loss depends only on its own row. (Michel et al.'s code takes |.| of the batch-summed gradient,
which lets opposite-signed examples cancel; with batch size 1 the two agree.) Scores are normalised per
layer by their l2 norm, so that layers with large gradients do not claim every top rank.

Ablation score: validation-loss increase when one head alone is masked (xi_h = 0, all others 1); L*H
forward passes over the validation subset. Both scores are computed in eval mode (no dropout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from headbudget.models.classifier import BudgetedClassifier
from headbudget.training.batches import TokenizedSplit, batches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Importance:
    """Per-head scores, each shape (L, H)."""

    gradient: np.ndarray  # E|dL/dxi_h|, l2-normalised per layer
    gradient_raw: np.ndarray  # E|dL/dxi_h| before normalisation
    ablation: np.ndarray | None  # validation loss with head h masked minus the unmasked loss
    base_loss: float | None  # unmasked validation loss
    n_examples: int

    def ranking(self) -> np.ndarray:
        """Flat head indices l * H + h, most important first (ties by (layer, head) order)."""
        g = self.gradient.ravel()
        return np.lexsort((np.arange(g.size), -g)).astype(np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gradient": self.gradient.tolist(),
            "gradient_raw": self.gradient_raw.tolist(),
            "ablation": None if self.ablation is None else self.ablation.tolist(),
            "base_loss": self.base_loss,
            "n_examples": self.n_examples,
            "ranking": self.ranking().tolist(),
        }


def head_gradients(model: BudgetedClassifier, ids: torch.Tensor, mask: torch.Tensor,
                   labels: torch.Tensor) -> torch.Tensor:
    """Per-example dL(x)/dxi at xi = 1 for a batch: shape (B, L, H), L = cross-entropy of each example."""
    c = model.cfg
    dtype = model.classifier.weight.dtype
    xi = torch.ones(ids.shape[0], c.n_layers, c.n_heads, dtype=dtype, device=ids.device, requires_grad=True)
    logits = model(ids, mask, xi)  # (B, C)
    loss = F.cross_entropy(logits, labels, reduction="sum")  # the sum: row b of the gradient is dL(x_b)/dxi_b
    (grad,) = torch.autograd.grad(loss, xi)
    return grad.detach()


def normalise_per_layer(scores: np.ndarray) -> np.ndarray:
    """Divide each layer's row by its l2 norm (rows of zeros stay zero)."""
    norms = np.linalg.norm(scores, axis=1, keepdims=True)
    return scores / np.where(norms > 0, norms, 1.0)


def gradient_importance(model: BudgetedClassifier, data: TokenizedSplit, batch_size: int = 32) -> np.ndarray:
    """E_x |dL(x)/dxi_h| over ``data``, shape (L, H), not yet normalised; one forward/backward per batch."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64)
    for ids, mask, y in batches(data, batch_size, device):
        total += head_gradients(model, ids, mask, y).abs().sum(0).double().cpu()
    model.train(was_training)
    return (total / max(1, len(data))).numpy()


@torch.no_grad()
def mean_loss(model: BudgetedClassifier, data: TokenizedSplit, head_gate: torch.Tensor | None,
              batch_size: int = 128) -> float:
    """Mean cross-entropy over ``data`` with a fixed (L, H) head gate (None = dense)."""
    device = next(model.parameters()).device
    total = 0.0
    for ids, mask, y in batches(data, batch_size, device):
        total += float(F.cross_entropy(model(ids, mask, head_gate), y, reduction="sum"))
    return total / max(1, len(data))


@torch.no_grad()
def ablation_importance(model: BudgetedClassifier, data: TokenizedSplit) -> tuple[np.ndarray, float]:
    """Loss increase when masking each head alone, shape (L, H), and the unmasked loss."""
    was_training = model.training
    model.eval()
    c = model.cfg
    device = next(model.parameters()).device
    base = mean_loss(model, data, None)
    out = np.zeros((c.n_layers, c.n_heads))
    for layer in range(c.n_layers):
        for head in range(c.n_heads):
            gate = torch.ones(c.n_layers, c.n_heads, device=device)
            gate[layer, head] = 0.0
            out[layer, head] = mean_loss(model, data, gate) - base
        log.info("ablation: layer %d done", layer)
    model.train(was_training)
    return out, base


def head_importance(model: BudgetedClassifier, train: TokenizedSplit, val: TokenizedSplit | None,
                    batch_size: int = 32) -> Importance:
    """Both scores: gradient importance on ``train``, masking ablation on ``val`` (skipped when None)."""
    raw = gradient_importance(model, train, batch_size)
    ablation, base = ablation_importance(model, val) if val is not None and len(val) else (None, None)
    return Importance(normalise_per_layer(raw), raw, ablation, base, len(train))


def importance_heatmap(imp: Importance, path: Any, title: str = "head importance") -> None:
    """Layers x heads heatmaps of the two scores, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("gradient importance E|dL/dxi| (l2 per layer)", imp.gradient)]
    if imp.ablation is not None:
        panels.append(("validation-loss increase when masked alone", imp.ablation))
    n_layers, n_heads = imp.gradient.shape
    fig, axes = plt.subplots(1, len(panels), figsize=(1.2 + 0.55 * n_heads * len(panels), 1.6 + 0.45 * n_layers),
                             dpi=120, squeeze=False)
    for ax, (name, values) in zip(axes[0], panels, strict=True):
        im = ax.imshow(values, cmap="viridis", aspect="auto")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(n_heads))
        ax.set_yticks(range(n_layers))
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"{title} (n={imp.n_examples})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
