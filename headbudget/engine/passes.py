"""A batch's texts in forward passes: grouped by length, so that little padding runs, and under a memory cap.

One pass of B texts padded to N tokens holds, at its peak, fp32 activations of about (k: the plan's most heads in
a layer, w: its widest feed-forward block, D: the hidden width)
  attention:     2 copies of the scores (B, k, N, N) + 4 (B*N, D)
  feed-forward:  2 (B*N, w) + 6 (B*N, D)
whichever is larger, plus 1 MiB: an upper bound of one pass's peak resident memory in ONNX Runtime, int8 and fp32,
at every budget, batch and length (docs/results.md, 'Memory under large requests'). Scores grow with N squared,
so the cap bounds long texts by how many share a pass, and short ones hardly at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from headbudget.models.plan import ExecutionPlan, Shape

MiB = 1 << 20
# A batch that ran in several passes, or in one estimated above this (no cap, or a cap above it), gives its memory
# back when it is done: once per batch, as memory given back is faulted in again by the next pass. A batch of one
# smaller pass keeps it in ONNX Runtime's arena for the next (giving back after every run slows a busy server),
# and the arena then holds no more than one pass under the cap (docs/results.md, 'Memory under large requests').
KEEP_BYTES = 256 * MiB
# Padding a pass may add, as a share of its texts' own tokens: a padded token costs what a real one does.
PAD_SHARE = 0.125


def activation_bytes(shape: Shape, plan: ExecutionPlan, batch: int, length: int) -> int:
    """The estimated peak activation bytes of one pass of ``batch`` texts padded to ``length`` tokens."""
    k = max(plan.heads, default=0)
    w = max(plan.ffn_widths(shape.intermediate), default=0)
    tokens = batch * length
    scores = batch * k * length * length * 4
    hidden = tokens * shape.hidden * 4
    return max(2 * scores + 4 * hidden, 2 * tokens * w * 4 + 6 * hidden) + MiB


def split(lengths: Sequence[int], fits: Callable[[int, int], bool],
          pad_share: float | None = PAD_SHARE) -> list[list[int]]:
    """The indices of texts of ``lengths`` tokens in passes, each ``fits(texts, padded length)``.

    A pass pads every text to its longest, so texts go by length, shortest first: a pass takes the next text
    while it fits and, unless ``pad_share`` is None, while the padding stays within ``pad_share`` of its texts'
    own tokens (docs/method.md, 'Batches by length'). A batch that is one pass either way runs in its order. A text
    that alone does not fit runs alone (the engine refuses a cap below one text of its longest length at load, so
    admitted input never gets there).
    """
    if not lengths:
        return []
    passes: list[list[int]] = []
    current: list[int] = []
    own = 0  # tokens of the current pass's texts, unpadded
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        n = lengths[i]  # sorted: text i is the longest so far
        if current and (not fits(len(current) + 1, n) or
                        (pad_share is not None and (len(current) + 1) * n > (1 + pad_share) * (own + n))):
            passes.append(current)
            current, own = [], 0
        current.append(i)
        own += n
    passes.append(current)
    return [list(range(len(lengths)))] if len(passes) == 1 else passes


def padded_tokens(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    """Tokens the passes ``groups`` run, padding included."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)
