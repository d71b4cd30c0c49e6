"""What a request asks to spend: one object from the HTTP edge through the queue to the engine.

A request names a fixed budget, ``auto`` under a ceiling, or a latency target. The service's planner turns a
latency target into a budget (it depends on the queue) and may lower any budget under load (``at``); the
engine runs a ``Fixed`` or an ``Auto`` (``Engine.run``), and the checkpoint says how it serves ``auto``
(``ModelInfo.resolve``). Nobody downstream re-reads the client's fields.

What a kind means for pricing and planning lives here, one method per question: the most it may run
(``priced``: what admission prices and reserves), the budget it states before it is planned (``stated``: its
weight in the queue), and the budget it asks for at dispatch (``want``). A new kind is one class here and its
HTTP edge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Auto", "BudgetRequest", "Fixed", "LatencyTarget", "Runnable"]


@dataclass(frozen=True)
class Fixed:
    """Every text at ``budget`` (on a type that picks its own heads per input: a cap on that choice)."""

    budget: float

    def at(self, budget: float) -> Fixed:
        """This request run at ``budget`` (the planner's choice: its own, or lower under load)."""
        return Fixed(budget)

    def priced(self, max_budget: float) -> float:
        """The most it may run under a tier of ``max_budget``: its budget (a cap, on a type that picks its own
        heads)."""
        return self.budget

    def stated(self, default: float) -> float:
        return self.budget

    def want(self, waited_s: float, allowed: Sequence[float], cost_s: Callable[[float], float]) -> float:
        return self.budget


@dataclass(frozen=True)
class Auto:
    """``budget=auto``: each text at the budgets the checkpoint picks for it, all its passes together never above
    one pass at ``ceiling``."""

    ceiling: float = 1.0
    target: float | None = None  # a decider's operating point calibrated for this mean cost (None: its default)

    def at(self, budget: float) -> Auto:
        """This request under the ceiling ``budget`` (lower than its own under load)."""
        return Auto(budget, self.target)

    def priced(self, max_budget: float) -> float:
        """Its ceiling: all of a text's passes together never cost more than one pass there."""
        return self.ceiling

    def stated(self, default: float) -> float:
        return self.ceiling

    def want(self, waited_s: float, allowed: Sequence[float], cost_s: Callable[[float], float]) -> float:
        return self.ceiling


@dataclass(frozen=True)
class LatencyTarget:
    """The highest budget whose estimated latency for the texts fits ``max_latency_ms``; the service's planner
    resolves it to a budget when the request is scheduled (never sent to an engine as such)."""

    max_latency_ms: float

    def at(self, budget: float) -> Fixed:
        """The budget the planner found for this target."""
        return Fixed(budget)

    def priced(self, max_budget: float) -> float:
        """The tier's maximum: the planner may pick any budget up to it."""
        return max_budget

    def stated(self, default: float) -> float:
        """``default`` (the tier's): its budget depends on the queue, known only at dispatch."""
        return default

    def want(self, waited_s: float, allowed: Sequence[float], cost_s: Callable[[float], float]) -> float:
        """The highest of ``allowed`` (ascending) whose estimated seconds (``cost_s``) fit the time left after
        ``waited_s`` in the queue; the lowest when none does."""
        left_s = self.max_latency_ms / 1000.0 - waited_s
        fitting = [b for b in allowed if cost_s(b) <= left_s]
        return fitting[-1] if fitting else allowed[0]


BudgetRequest = Fixed | Auto | LatencyTarget
Runnable = Fixed | Auto  # what an engine runs
