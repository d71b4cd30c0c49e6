"""Multiply-add accounting for the adaptive model types, head by head, at what the fast path really computes.

The budgeted type's count (models/plan.py) assumes every active head is full width and sees every key. The
adaptive types break both: AdaAttention runs a head at d' < d_h dimensions, adaptive span lets each query see
only its window. So a head is counted by its width d' and by the keys per query its kernel multiplies:
    head = 3·n·D·d' (its Q/K/V rows) + 2·n·keys·d' (scores and values) + n·d'·D (its W_O columns)
which with d' = d_h and keys = n for every head is exactly ``cost.attention_macs``. The small networks the
adaptive types add (BudgetFormer's f and g, AdaAttention's scorer) are counted on top, in total_macs only;
each type's count is the ``side_macs`` of its module in models/, reached through engine/adaptive/model_types.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from headbudget.engine.types import Cost
from headbudget.models.plan import Shape, attention_macs, ffn_macs


def head_macs(hidden: int, n_tokens: int, width: int, pairs: int) -> int:
    """MACs of one head of ``width`` dimensions over ``n_tokens`` tokens multiplying ``pairs`` (query, key) pairs."""
    n = n_tokens
    return 3 * n * hidden * width + 2 * pairs * width + n * width * hidden


def span_block(window: int) -> int:
    """Queries per block of the banded span kernel: w/2, the fastest block over the windows the span type learns."""
    return max(8, window // 2)


def span_blocked(window: int, n_tokens: int) -> bool:
    """Whether the banded kernel runs: only when it multiplies at most 3/4 of the n * n pairs, because building
    its padded blocks and bias costs time too (a band as large as dense runs slower than dense)."""
    block = span_block(window)
    keys = block + 2 * window - 2
    return keys < n_tokens and 4 * (-(-n_tokens // block) * block * keys) <= 3 * n_tokens * n_tokens


def span_pairs(window: int, n_tokens: int) -> int:
    """(query, key) pairs the span kernel multiplies for one head of ``window`` on ``n_tokens`` tokens.

    Queries run in blocks of B = span_block(w); a block multiplies the B + 2w - 2 keys any of its queries can
    see (K/V zero-padded at both ends, the last block padded to B queries). Where ``span_blocked`` says no, the
    dense kernel with the ramp as a bias runs instead: n * n (engine/adaptive/backend.py).
    """
    if not span_blocked(window, n_tokens):
        return n_tokens * n_tokens
    block = span_block(window)
    return -(-n_tokens // block) * block * (block + 2 * window - 2)


@dataclass
class Usage:
    """What one input ran: per layer its active heads and attention MACs, plus the side networks' MACs."""

    heads: list[int] = field(default_factory=list)
    attention: list[int] = field(default_factory=list)
    extra: int = 0

    def add(self, heads: int, attention: int, extra: int) -> None:
        self.heads.append(heads)
        self.attention.append(attention)
        self.extra += extra


def usage_cost(shape: Shape, usage: Usage, n_tokens: int) -> Cost:
    """The Cost of one input from its Usage; the dense figures are the plain dense encoder (no side networks)."""
    n_layers = len(usage.heads)
    attn_dense = n_layers * attention_macs(shape, shape.n_heads, n_tokens)
    rest = n_layers * ffn_macs(shape, n_tokens) + shape.hidden * shape.n_labels
    attn = sum(usage.attention)
    return Cost(
        heads_active=sum(usage.heads),
        heads_total=n_layers * shape.n_heads,
        attention_macs=attn,
        attention_macs_dense=attn_dense,
        total_macs=attn + usage.extra + rest,
        total_macs_dense=attn_dense + rest,
    )


def plan_macs(hidden: int, n_tokens: int, widths: Sequence[int], pairs: Sequence[int]) -> int:
    """Attention MACs of one layer running heads of ``widths`` that multiply ``pairs`` (query, key) pairs."""
    return sum(head_macs(hidden, n_tokens, w, p) for w, p in zip(widths, pairs, strict=True))
