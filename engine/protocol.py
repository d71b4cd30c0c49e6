"""The Engine interface: everything the service and the benchmark may call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from headbudget.engine.types import BatchResult, ModelInfo


class Engine(Protocol):
    """Runs a checkpoint at a budget. One instance = one thread; not safe to call from two threads at once."""

    info: ModelInfo

    def mask_key(self, budget: float) -> int:
        """An id of the head mask ``budget`` selects; requests with equal keys can share a batch.

        Kept-head sets are nested and determined by k = round(b * L * H), so the key is k.
        """
        ...

    def heads_at(self, budget: float) -> int:
        """The most heads one input may run at ``budget``: exactly those it runs for the budgeted type, the
        cap for a type that picks its own heads (each answer's cost says what it really ran)."""
        ...

    def count_tokens(self, texts: Sequence[str]) -> list[tuple[int, bool]]:
        """(tokens after truncation, truncated?) per text, without running the model."""
        ...

    def predict(self, texts: Sequence[str], budget: float) -> BatchResult:
        """Classify ``texts`` (padded to the longest in the batch) running only the heads ``budget`` buys."""
        ...

    def warmup(self) -> None:
        """Build and touch every graph/session the budget grid needs, so first requests are not slow."""
        ...

    def close(self) -> None:
        """Release sessions and threads."""
        ...
