"""What each precision changes, in one table: the weight store's layout, the graphs' operators, the backends.

Code asks ``PRECISIONS[precision]`` what to do; nothing else compares a precision's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from headbudget.engine.types import Precision


@dataclass(frozen=True)
class PrecisionSpec:
    """One precision's behaviour."""

    # Weight matrices symmetric int8 with one scale per output column (per neuron for W1 stored as rows) and
    # the word table int8 rows with one scale each (weights.pack); the graphs quantize activations per call
    # (DynamicQuantizeMatMul, or DynamicQuantizeLinear + QGemm over W1 rows).
    quantized: bool
    # Block output biases folded into the norms (weights.fold_residual_biases), so a block's second Gemm adds
    # the residual as its C input. DynamicQuantizeMatMul has no C input: quantized stores stay plain.
    folds_residual_biases: bool
    # Q/K/V stored (D, H*3*dh), the (K, N) layout DynamicQuantizeMatMul wants: a head prefix is then a column
    # copy, one per (layer, heads) shared by all sessions (bind.SliceCache). Otherwise (H*3*dh, D), a head
    # prefix is a row view and the Gemm runs with transB=1.
    qkv_by_columns: bool
    weight_dtype: type[np.generic]  # of the stored matrices (biases, norms and scales are float32)
    torch_engines: bool  # the PyTorch engines (the reference and the adaptive fast path) run it
    # Widths, as fractions of a layer's neurons (heads), whose prefixes the all-budget graph also holds as
    # initializers, so that ONNX Runtime packs them once: a block of any width runs the largest such prefix
    # packed and only the rest, fed per call, unpacked (graph.build_dynamic). An unpacked product packs its
    # weights on every call; at AG News lengths that made budgets between the prepacked ones cost more than the
    # whole model (docs/results.md, 'Every budget costs what it says'). Each level is one more If node per
    # block on every call: int8, whose packing is cheap, keeps one feed-forward level (a second and attention
    # levels cost the small budgets more than they saved the large ones); fp32 keeps two of each.
    ffn_levels: tuple[float, ...] = ()
    attention_levels: tuple[float, ...] = ()
    # Plans that multiply by at most this share of the layers' weights, no block at all its units
    # (bind.runs_fed), run a graph without If nodes, every weight fed per call (graph.build_dynamic's
    # ``fed``): there the branches cost more than packing the plan's weights on every call. Where that stops
    # paying differs per precision (docs/results.md, 'Every budget costs what it says'): fp32 weights, four
    # times int8's bytes, cost more to pack.
    fed_up_to: float = 0.0
    # The neurons of W1 fed per call (all of a small plan's, the rest above a level in the graph with branches)
    # as (D, w) column copies, one per (layer, first, end neuron) shared by every plan (bind.SliceCache),
    # not as a row view: ONNX Runtime transposes an unpacked transB weight on every call. int8 only: fp32's
    # Gemm runs as fast either way (weights.w1_by_rows).
    w1_fed_by_columns: bool = False

    def __post_init__(self) -> None:
        if self.w1_fed_by_columns and not self.quantized:
            raise ValueError("W1 fed by columns runs DynamicQuantizeMatMul: a quantized precision's layout")


PRECISIONS: Mapping[Precision, PrecisionSpec] = MappingProxyType({
    "fp32": PrecisionSpec(quantized=False, folds_residual_biases=True, qkv_by_columns=False,
                          weight_dtype=np.float32, torch_engines=True, ffn_levels=(1 / 3, 2 / 3),
                          attention_levels=(1 / 3, 2 / 3), fed_up_to=0.2),
    "int8": PrecisionSpec(quantized=True, folds_residual_biases=False, qkv_by_columns=True,
                          weight_dtype=np.int8, torch_engines=False, ffn_levels=(1 / 2,), fed_up_to=0.5,
                          w1_fed_by_columns=True),
})
