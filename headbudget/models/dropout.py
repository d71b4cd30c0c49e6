"""Dropout whose masks on a CPU may be drawn by numpy's PCG64 instead of torch's own generator (docs/method.md §6.4).

torch draws a CPU dropout mask one element at a time (MKL's Bernoulli on Intel CPUs, its serial generator
elsewhere); sixteen random bits an element from PCG64's 64-bit words cost a third as much. The masks are other
numbers, so a recipe opts in (``Recipe.drawn_dropout``); the seed of each mask comes from torch's generator, so
``torch.manual_seed`` still repeats a run. On other devices torch's dropout runs either way.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

_BITS = 16  # per element: p is kept to 1/65,536


def keep_mask(like: torch.Tensor, p: float) -> torch.Tensor:
    """A bool tensor shaped as ``like``: True with probability 1 - p (to 1/65,536), from a PCG64 stream seeded by
    torch's default generator."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    n = like.numel()
    words = np.random.PCG64(seed).random_raw((n * _BITS + 63) // 64)
    bits = words.view(np.uint16)[:n]
    return torch.from_numpy(bits >= round(p * (1 << _BITS))).view(like.shape)


class Dropout(nn.Dropout):
    """``nn.Dropout`` that, with ``drawn`` set and in training on a CPU, masks with ``keep_mask``."""

    drawn: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drawn and self.training and self.p > 0 and x.device.type == "cpu":
            return x * keep_mask(x, self.p) * (1.0 / (1.0 - self.p))
        return super().forward(x)


def draw_dropout_masks(model: nn.Module, drawn: bool) -> None:
    """Every ``Dropout`` of ``model`` masks with ``keep_mask`` (True) or with torch's dropout (False)."""
    for module in model.modules():
        if isinstance(module, Dropout):
            module.drawn = drawn
