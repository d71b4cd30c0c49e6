"""What int8 can do: the reference model run with int8 arithmetic simulated exactly, so that an int8 engine's
distance from fp32 is judged against the distance int8 itself makes, on any CPU.

The simulation quantizes what the engine quantizes (``engine/weights/pack.py``, ``engine/onnx/graph.py``): the word
table per row, every encoder matrix per output column (symmetric int8), and each matrix's input per call as one
u8 tensor (DynamicQuantizeLinear: an asymmetric range that holds 0). ONNX Runtime's u8 x s8 kernels then sum in
one of two ways, by instruction set: VNNI and AMX accumulate exactly in int32; AVX2 (and AVX-512 without VNNI)
add each pair of products in a saturating int16 first (vpmaddubsw), which moves the logits several times more.
An engine is within int8's noise when its distance from fp32 is at most the larger of the two simulations'
(``SLACK`` for float sums in another order and the kernels' own packing): a bound that int8's scales set, the
same on every CPU, and which a wrong weight leaves.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import MethodType

import numpy as np
import torch
from torch import nn

SLACK = 1.25  # relative to the larger simulated distance from fp32
FLOOR = 1e-3  # absolute, for budgets whose logits hardly move


def _rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row, as ``engine.weights.quantize_rows``: (integers, scales (R, 1))."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(w / scale), -127, 127), scale


def _u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DynamicQuantizeLinear: (integers in [0, 255], scale, zero point)."""
    lo, hi = torch.clamp(x.min(), max=0.0), torch.clamp(x.max(), min=0.0)
    scale = (hi - lo) / 255.0
    if scale == 0:
        scale = torch.ones_like(scale)
    zero = torch.clamp(torch.round(-lo / scale), 0, 255)
    return torch.clamp(torch.round(x / scale) + zero, 0, 255), scale, zero


def _int8_linear(saturating: bool) -> Callable[[nn.Linear, torch.Tensor], torch.Tensor]:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        xq, sx, zx = _u8(x.double())
        wq, sw = _rows(self.weight.double())  # (out, in)
        rows = xq.reshape(-1, xq.shape[-1])
        acc = rows @ wq.T
        if saturating:  # pairs of products summed in a saturating int16 first: correct the pairs that overflow
            k = rows.shape[1] - rows.shape[1] % 2
            even, odd = wq[:, 0:k:2], wq[:, 1:k:2]  # (out, K/2)
            # With x in [0, 255], only a pair whose two weights sum past 32767 / 255 in magnitude can overflow.
            out, pair = torch.nonzero((even.abs() + odd.abs()) * 255 > 32767, as_tuple=True)
            if len(out):
                sums = rows[:, 2 * pair] * even[out, pair] + rows[:, 2 * pair + 1] * odd[out, pair]  # (rows, n)
                acc = acc.index_add(1, out, torch.clamp(sums, -32768, 32767) - sums)
        y = (acc - zx * wq.sum(1)) * sx * sw[:, 0]
        if self.bias is not None:
            y = y + self.bias.double()
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)

    return forward


def simulated_int8(model: nn.Module, saturating: bool) -> nn.Module:
    """A copy of ``model`` whose encoder computes as int8 kernels do (heads and exits stay fp32, as served)."""
    sim = copy.deepcopy(model).eval()
    encoder = sim.encoder
    with torch.no_grad():
        word = encoder.embeddings.word.weight
        q, scale = _rows(word.double())
        word.copy_(q * scale)
        for layer in encoder.layers:
            for m in layer.modules():
                if isinstance(m, nn.Linear):
                    m.forward = MethodType(_int8_linear(saturating), m)  # type: ignore[method-assign]
    return sim


class Int8Noise:
    """The two simulations of one reference model; ``check`` judges an engine's logits against them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sims = (simulated_int8(model, saturating=False), simulated_int8(model, saturating=True))

    def check(self, got: np.ndarray, logits_of: Callable[[nn.Module], np.ndarray], what: str) -> np.ndarray:
        """Assert ``got`` is within int8's noise of the reference; returns the reference's logits."""
        ref = logits_of(self.model)
        assert np.isfinite(got).all(), what
        noise = max(float(np.abs(logits_of(sim) - ref).max()) for sim in self.sims)
        err, bound = float(np.abs(got - ref).max()), SLACK * noise + FLOOR
        assert err <= bound, f"{what}: int8 is {err:.4f} from fp32, beyond what int8 arithmetic makes ({bound:.4f})"
        return ref
