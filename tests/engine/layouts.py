"""How closely two int8 layouts of one checkpoint must agree at a budget."""

from __future__ import annotations

from typing import Any

from headbudget.engine.onnx.bind import runs_fed
from headbudget.engine.precision import PRECISIONS


def int8_layouts_atol(engine: Any, budget: float) -> float:
    """1e-5 where every feed-forward block the plan runs is one product in both layouts; where one runs a packed
    level and the rest (``PrecisionSpec.ffn_levels``), the two parts' activations are quantized apart, so the
    answers move within int8's noise of the one product. A small plan runs the graph without branches, whose
    every block is one product (``bind.runs_fed``)."""
    plan, width, levels = engine.plan(budget), engine.cfg.intermediate_size, engine.levels.neurons
    widths = plan.ffn_widths(width)[: plan.layers_run]
    fed = runs_fed(engine.cfg, plan, PRECISIONS[engine.precision].fed_up_to)
    split = not fed and any(w not in (width, *levels) and w > min(levels, default=width) for w in widths)
    return 0.05 if split else 1e-5
