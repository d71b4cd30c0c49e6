"""Latency estimates per budget and input size: the checkpoint's bench table, rescaled by what the service sees.

The table (bench.json, parsed by the engine into a ``BenchRecord``: latency per budget at the padded tokens per call)
gives the shape of latency over budgets; every batch the service runs updates a per-budget-bucket
correction factor (an exponential moving average of observed / estimated), so estimates follow the real
machine. Without a table a conservative prior is used until observations arrive.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Sequence

from headbudget.engine.types import BenchRecord
from headbudget.service.metrics import budget_bucket

DEFAULT_GRID: tuple[float, ...] = tuple(round(0.10 + 0.05 * i, 2) for i in range(19))
_ALPHA = 0.2  # weight of one new observation in the correction factor
_FIXED_SHARE = 0.2  # share of a single-point measurement treated as fixed per-call overhead


def _curve(points: Sequence[tuple[float, float]], tokens: float) -> float:
    """ms at ``tokens`` from one budget's measured points: linear between them, a fixed share below."""
    if len(points) == 1:
        t0, m0 = points[0]
        return m0 * (_FIXED_SHARE + (1 - _FIXED_SHARE) * tokens / t0)
    i = min(max(bisect_left([p[0] for p in points], tokens), 1), len(points) - 1)
    (t0, m0), (t1, m1) = points[i - 1], points[i]
    slope = max(0.0, (m1 - m0) / (t1 - t0)) if t1 > t0 else 0.0
    return max(m0 * _FIXED_SHARE, m0 + slope * (tokens - t0))


class LatencyModel:
    """Estimated wall time (ms) of one engine call at a budget on a number of padded tokens."""

    def __init__(self, bench: BenchRecord | None, max_length: int) -> None:
        self._table = bench.table if bench else {}
        self._budgets = sorted(self._table)
        self.max_length = max_length
        self.ref_tokens = bench.reference_tokens if bench else 128.0
        self._factor: dict[str, float] = {}  # budget bucket -> observed / estimated
        self._global = 1.0
        self._chars_per_token = 4.0
        self._lock = threading.Lock()

    @property
    def has_table(self) -> bool:
        """Whether estimates come from a measured table (else from a prior)."""
        return bool(self._table)

    def grid(self) -> list[float]:
        """The budgets the service chooses among (table budgets plus the 0.05-step grid)."""
        return sorted(set(DEFAULT_GRID) | set(self._budgets))

    def _base_ms(self, budget: float, tokens: float) -> float:
        if not self._table:  # prior: about 20 us per token at full budget on one core, plus 0.5 ms per call
            return 0.5 + tokens * 0.02 * (0.3 + 0.7 * budget)
        bs = self._budgets
        if budget <= bs[0] or len(bs) == 1:
            return _curve(self._table[bs[0]], tokens) * math.sqrt(budget / bs[0] if budget < bs[0] else 1.0)
        if budget >= bs[-1]:
            return _curve(self._table[bs[-1]], tokens)
        i = bisect_left(bs, budget)
        b0, b1 = bs[i - 1], bs[i]
        w = (budget - b0) / (b1 - b0)
        return (1 - w) * _curve(self._table[b0], tokens) + w * _curve(self._table[b1], tokens)

    def estimate_ms(self, budget: float, tokens: float) -> float:
        """Estimated ms of one call at ``budget`` that runs ``tokens`` tokens, padding included."""
        factor = self._factor.get(budget_bucket(budget), self._global)
        return self._base_ms(budget, max(1.0, tokens)) * factor

    def observe(self, budget: float, tokens: float, ms: float) -> None:
        """Fold one measured call into the correction factors."""
        base = self._base_ms(budget, max(1.0, tokens))
        if base <= 0 or not math.isfinite(ms) or ms <= 0:
            return
        ratio = min(20.0, max(0.05, ms / base))
        label = budget_bucket(budget)
        with self._lock:
            old = self._factor.get(label)
            self._factor[label] = ratio if old is None else (1 - _ALPHA) * old + _ALPHA * ratio
            self._global = (1 - _ALPHA) * self._global + _ALPHA * ratio

    def observe_text(self, chars: int, tokens: int) -> None:
        """Learn how many characters make a token, for estimates before tokenization."""
        if chars > 0 and tokens > 2:
            self._chars_per_token = 0.95 * self._chars_per_token + 0.05 * (chars / (tokens - 2))

    def estimate_tokens(self, texts: Sequence[str]) -> int:
        """Tokens of ``texts``, estimated from their length in characters (the engine runs a batch in passes by
        length, so a request costs about its texts' own tokens, not its count times its longest)."""
        return sum(min(self.max_length, math.ceil(len(t) / self._chars_per_token) + 2) for t in texts)

    def estimates_ms(self, budgets: Sequence[float], tokens: float) -> list[float]:
        """``estimate_ms`` of each budget (ascending), never below a smaller one's: plans are nested, so a larger
        budget does all of a smaller one's work, and the budget buckets' corrections only differ by noise."""
        out: list[float] = []
        for b in budgets:
            out.append(max(self.estimate_ms(b, tokens), out[-1] if out else 0.0))
        return out

    def table_points(self) -> dict[float, float]:
        """Estimated ms per table budget at the table's reference input, with the corrections applied."""
        return {b: round(self.estimate_ms(b, self.ref_tokens), 3) for b in self._budgets}
