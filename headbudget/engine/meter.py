"""What a request will cost before it runs: exact token counts and a budget's multiply-adds, off the engine thread.

The service prices a request at admission (its compute quota and per-request cap) while the engine's one thread
may be in the middle of a forward pass. A ``TokenMeter`` therefore has a tokenizer of its own and prices plans
that are plain data, so it never touches the engine's sessions, caches or tokenizer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from headbudget.engine.types import Cost, ExecutionPlan, Tokens
from headbudget.models.plan import Shape
from headbudget.models.tokenizer import TextEncoder


class TokenMeter:
    """The Meter of the engines built on EngineBase (engine/protocol.py ``Meter``)."""

    def __init__(self, encoder: TextEncoder, shape: Shape, plan: Callable[[float], ExecutionPlan]) -> None:
        self._encoder = encoder  # a copy of the engine's: same tokenizer file, same max_length
        self._shape = shape
        self._plan = plan  # budget -> plan, without side effects on the engine
        self._lock = threading.Lock()  # one tokenizer, callers on several threads (the loop, its executor)
        self._plans: dict[float, ExecutionPlan] = {}
        # (budget, tokens) -> Cost: a plan's cost is a sum over layers in Python, and admission prices every text
        self._costs: dict[tuple[float, int], Cost] = {}

    def count_tokens(self, texts: Sequence[str]) -> list[tuple[int, bool]]:
        return self.tokenize(texts).counts()

    def fewest_tokens(self, texts: Sequence[str]) -> list[int]:
        return self._encoder.fewest_tokens(list(texts))  # no tokenizer call: no lock

    def tokenize(self, texts: Sequence[str]) -> Tokens:
        with self._lock:
            enc = self._encoder.encode(list(texts))
        return Tokens(enc.ids, enc.truncated)

    def cost(self, budget: float, n_tokens: int) -> Cost:
        cost = self._costs.get((budget, n_tokens))
        if cost is None:
            plan = self._plans.get(budget)
            if plan is None:
                if len(self._plans) > 10_000:  # budgets are any number: keep the caches bounded
                    self._plans.clear()
                plan = self._plans[budget] = self._plan(budget)
            if len(self._costs) > 50_000:
                self._costs.clear()
            cost = self._costs[(budget, n_tokens)] = plan.cost(self._shape, n_tokens)
        return cost
