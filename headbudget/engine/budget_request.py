"""What a request asks to spend: one object from the HTTP edge through the queue to the engine.

A request names a fixed budget, ``auto`` under a ceiling, or a latency target. The service's planner turns a
latency target into a budget (it depends on the queue) and may lower any budget under load (``at``); the
engine runs a ``Fixed`` or an ``Auto`` (``Engine.run``), and the checkpoint says how it serves ``auto``
(``ModelInfo.resolve``). Nobody downstream re-reads the client's fields.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Auto", "BudgetRequest", "Fixed", "LatencyTarget", "Runnable"]


@dataclass(frozen=True)
class Fixed:
    """Every text at ``budget`` (on a type that picks its own heads per input: a cap on that choice)."""

    budget: float

    def at(self, budget: float) -> Fixed:
        """This request run at ``budget`` (the planner's choice: its own, or lower under load)."""
        return Fixed(budget)


@dataclass(frozen=True)
class Auto:
    """``budget=auto``: each text at the budgets the checkpoint picks for it, all its passes together never above
    one pass at ``ceiling``."""

    ceiling: float = 1.0
    target: float | None = None  # a decider's operating point calibrated for this mean cost (None: its default)

    def at(self, budget: float) -> Auto:
        """This request under the ceiling ``budget`` (lower than its own under load)."""
        return Auto(budget, self.target)


@dataclass(frozen=True)
class LatencyTarget:
    """The highest budget whose estimated latency for the texts fits ``max_latency_ms``; the service's planner
    resolves it to a budget when the request is scheduled (never sent to an engine as such)."""

    max_latency_ms: float

    def at(self, budget: float) -> Fixed:
        """The budget the planner found for this target."""
        return Fixed(budget)


BudgetRequest = Fixed | Auto | LatencyTarget
Runnable = Fixed | Auto  # what an engine runs
