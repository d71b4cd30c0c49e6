"""Head importance (docs/method.md §9, Michel et al. 2019) and the masking-ablation score.

Gradient importance: attach a mask variable xi_h = 1 to every head (the classifier's ``head_gate``, which
multiplies each head's output before W_O) and take I_h = E_x |dL(x)/d xi_h|. The definition has the
absolute value *inside* the expectation, so we give every example its own xi (head_gate of shape (B, L, H)
requiring grad): one backward pass of the summed loss then yields every example's own gradient, because an
example's loss depends only on its own row. (Michel et al.'s code takes |.| of the batch-summed gradient,
which lets opposite-signed examples cancel; with batch size 1 the two agree.) Scores are normalised per
layer by their l2 norm, so that layers with large gradients do not claim every top rank.

Feed-forward units (docs/method.md §4): the same score for a mask variable xi_i on every
feed-forward neuron, multiplying its GELU output before the second matrix (a pre-hook on ``ffn_out``, so any
model, whatever its gate scope, can be scored). A group of G neurons under one mask variable xi_g has, per
example, dL/dxi_g = sum over its neurons of dL/dxi_i (the group's variable multiplies each of their outputs),
so one backward pass gives both the per-neuron score (the half-width baseline keeps neurons) and the
per-group score E|dL/dxi_g| (the whole-model ranking), each with |.| inside the expectation as for heads.

Ablation score: validation-loss increase when one head alone is masked (xi_h = 0, all others 1); L*H
forward passes over the validation subset. All scores are computed in eval mode (no dropout).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from headbudget.models.classifier import BudgetedClassifier
from headbudget.training.batches import TokenizedSplit, batches

log = logging.getLogger(__name__)


def _ranking(scores: np.ndarray) -> np.ndarray:
    """Flat indices of ``scores``, largest first, ties by flat index."""
    g = scores.ravel()
    return np.lexsort((np.arange(g.size), -g)).astype(np.int64)


@dataclass(frozen=True)
class Importance:
    """Per-head scores, each shape (L, H); with ``ffn_group``, feed-forward scores too (whole-model units)."""

    gradient: np.ndarray  # E|dL/dxi_h|, l2-normalised per layer
    gradient_raw: np.ndarray  # E|dL/dxi_h| before normalisation
    ablation: np.ndarray | None  # validation loss with head h masked minus the unmasked loss
    base_loss: float | None  # unmasked validation loss
    n_examples: int
    neuron_raw: np.ndarray | None = None  # (L, I) E|dL/dxi_i| per feed-forward neuron
    group_raw: np.ndarray | None = None  # (L, G) E|dL/dxi_g| per group of ``ffn_group`` neurons
    ffn_group: int | None = None

    def ranking(self) -> np.ndarray:
        """Flat head indices l * H + h, most important first (ties by (layer, head) order)."""
        return _ranking(self.gradient)

    @property
    def units(self) -> np.ndarray:
        """(L, U = H + G) whole-model unit scores, heads then groups, normalised per layer over all its units.

        One l2 norm per layer over heads and groups together, not one per kind: both raw scores are the same
        quantity (the first-order loss change of removing the unit, xi 1 -> 0), so within a layer they are
        comparable as they are, while a norm per kind would fix each kind's share of the layer's importance and
        make a unit's score depend on how many units of its kind the layer has (12 heads against 24 groups in
        MiniLM). Layers are still equalised, which is why section 4 normalises at all.
        """
        if self.group_raw is None:
            raise ValueError("no feed-forward scores: computed without ffn_group")
        return normalise_per_layer(np.concatenate([self.gradient_raw, self.group_raw], axis=1))

    def unit_ranking(self) -> np.ndarray:
        """Flat unit indices l * U + u over heads and feed-forward groups, most important first."""
        return _ranking(self.units)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "gradient": self.gradient.tolist(),
            "gradient_raw": self.gradient_raw.tolist(),
            "ablation": None if self.ablation is None else self.ablation.tolist(),
            "base_loss": self.base_loss,
            "n_examples": self.n_examples,
            "ranking": self.ranking().tolist(),
        }
        if self.group_raw is not None and self.neuron_raw is not None:  # absent: the attention-scope file as it was
            d.update({"ffn_group": self.ffn_group, "neuron_raw": self.neuron_raw.tolist(),
                      "group_raw": self.group_raw.tolist(), "unit_ranking": self.unit_ranking().tolist()})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Importance:
        """Rebuild from ``to_dict`` output (importance.json)."""
        def arr(key: str) -> np.ndarray | None:
            return None if d.get(key) is None else np.asarray(d[key], dtype=np.float64)

        return cls(np.asarray(d["gradient"]), np.asarray(d["gradient_raw"]), arr("ablation"), d["base_loss"],
                   d["n_examples"], arr("neuron_raw"), arr("group_raw"), d.get("ffn_group"))


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


@contextmanager
def neuron_masks(model: BudgetedClassifier, xi: torch.Tensor) -> Iterator[None]:
    """Multiply layer l's GELU outputs by ``xi[:, l]`` (B, L, I) inside the block (pre-hooks on ``ffn_out``)."""
    def hook(layer: int):  # type: ignore[no-untyped-def]
        return lambda _module, args: (args[0] * xi[:, layer, None, :].to(args[0].dtype),)

    handles = [blk.ffn_out.register_forward_pre_hook(hook(i)) for i, blk in enumerate(model.encoder.layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def unit_gradients(model: BudgetedClassifier, ids: torch.Tensor, mask: torch.Tensor,
                   labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example dL(x)/dxi at xi = 1 for every head (B, L, H) and every feed-forward neuron (B, L, I)."""
    c = model.cfg
    dtype = model.classifier.weight.dtype
    xi_h = torch.ones(ids.shape[0], c.n_layers, c.n_heads, dtype=dtype, device=ids.device, requires_grad=True)
    xi_n = torch.ones(ids.shape[0], c.n_layers, c.intermediate_size, dtype=dtype, device=ids.device,
                      requires_grad=True)
    with neuron_masks(model, xi_n):
        logits = model(ids, mask, xi_h)  # (B, C); an (L, H) gate leaves any feed-forward gates out
    loss = F.cross_entropy(logits, labels, reduction="sum")
    grad_h, grad_n = torch.autograd.grad(loss, (xi_h, xi_n))
    return grad_h.detach(), grad_n.detach()


def group_sums(neuron_grads: torch.Tensor, group: int) -> torch.Tensor:
    """(B, L, I) per-neuron gradients -> (B, L, I / group): dL/dxi_g of each group's shared mask variable."""
    b, n_layers, width = neuron_grads.shape
    if width % group:
        raise ValueError(f"ffn_group {group} does not divide the feed-forward width {width}")
    return neuron_grads.reshape(b, n_layers, width // group, group).sum(-1)


def ffn_importance(model: BudgetedClassifier, data: TokenizedSplit, group: int,
                   batch_size: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """E_x|dL/dxi| for heads (L, H), neurons (L, I) and groups of ``group`` neurons (L, I / group), raw."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    c = model.cfg
    heads = torch.zeros(c.n_layers, c.n_heads, dtype=torch.float64)
    neurons = torch.zeros(c.n_layers, c.intermediate_size, dtype=torch.float64)
    groups = torch.zeros(c.n_layers, c.intermediate_size // group, dtype=torch.float64)
    for ids, mask, y in batches(data, batch_size, device):
        gh, gn = unit_gradients(model, ids, mask, y)
        heads += gh.abs().sum(0).double().cpu()
        neurons += gn.abs().sum(0).double().cpu()
        groups += group_sums(gn, group).abs().sum(0).double().cpu()
    model.train(was_training)
    n = max(1, len(data))
    return (heads / n).numpy(), (neurons / n).numpy(), (groups / n).numpy()


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
                    batch_size: int = 32, ffn_group: int | None = None) -> Importance:
    """Both scores: gradient importance on ``train``, masking ablation on ``val`` (skipped when None).

    ``ffn_group``: also score every feed-forward neuron and group of that many neurons (whole-model units).
    """
    neurons = groups = None
    if ffn_group is None:
        raw = gradient_importance(model, train, batch_size)
    else:
        raw, neurons, groups = ffn_importance(model, train, ffn_group, batch_size)
    ablation, base = ablation_importance(model, val) if val is not None and len(val) else (None, None)
    return Importance(normalise_per_layer(raw), raw, ablation, base, len(train), neurons, groups, ffn_group)


def importance_heatmap(imp: Importance, path: Any, title: str = "head importance") -> None:
    """Layers x heads heatmaps of the two scores, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("gradient importance E|dL/dxi| (l2 per layer)", imp.gradient, "head")]
    if imp.ablation is not None:
        panels.append(("validation-loss increase when masked alone", imp.ablation, "head"))
    n_layers, n_heads = imp.gradient.shape
    if imp.group_raw is not None:
        panels.append(("feed-forward groups E|dL/dxi_g| (l2 per layer with heads)", imp.units[:, n_heads:],
                       f"group of {imp.ffn_group} neurons"))
    width = sum(values.shape[1] for _, values, _ in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(1.2 + 0.55 * width, 1.6 + 0.45 * n_layers),
                             dpi=120, squeeze=False)
    for ax, (name, values, xlabel) in zip(axes[0], panels, strict=True):
        im = ax.imshow(values, cmap="viridis", aspect="auto")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("layer")
        ax.set_xticks(range(values.shape[1]))
        ax.set_yticks(range(n_layers))
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"{title} (n={imp.n_examples})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
