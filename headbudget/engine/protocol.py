"""The Engine interface: everything the service may call; TokenEngine adds what measurement tools drive."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from headbudget.engine.types import BatchResult, Cost, ExecutionPlan, ModelInfo, Runnable, Tokens
from headbudget.models.config import ModelConfig
from headbudget.models.plan import Shape

if TYPE_CHECKING:  # the service imports this module and never the tokenizer's (tests/service/test_config.py)
    from headbudget.models.tokenizer import TextEncoder


class Meter(Protocol):
    """Prices requests before they run. Unlike the Engine, safe to call from any thread: it has a tokenizer of its
    own and its plans are plain data, so admission can price a request while a forward pass runs."""

    def count_tokens(self, texts: Sequence[str]) -> list[tuple[int, bool]]:
        """(tokens after truncation, truncated?) per text: what the engine will count."""
        ...

    def fewest_tokens(self, texts: Sequence[str]) -> list[int]:
        """A lower bound on each text's ``count_tokens`` that needs no tokenizer (microseconds): what admission
        refuses a request for before it tokenizes it."""
        ...

    def tokenize(self, texts: Sequence[str]) -> Tokens:
        """The texts' token ids as the engine runs them (after truncation), which ``Engine.run`` takes instead of
        tokenizing them again."""
        ...

    def cost(self, budget: float, n_tokens: int) -> Cost:
        """One pass at ``budget`` for a text of ``n_tokens``: what a Prediction at that budget reports (for a type
        that picks its own heads per input, the cap: the most that input may run)."""
        ...


class Engine(Protocol):
    """Runs a checkpoint at a budget. One instance = one thread; not safe to call from two threads at once."""

    info: ModelInfo

    def plan(self, budget: float) -> ExecutionPlan:
        """What a forward pass at ``budget`` runs (BudgetError if ``budget`` is not a number in [0, 1]).

        Requests whose plans share a ``key`` can share a batch. For a type that picks its own heads per input
        the plan is the cap; each answer's cost says what that input really ran.
        """
        ...

    def count_tokens(self, texts: Sequence[str]) -> list[tuple[int, bool]]:
        """(tokens after truncation, truncated?) per text, without running the model."""
        ...

    def meter(self) -> Meter:
        """A Meter for this checkpoint (call once, on the engine's thread; the Meter may then go anywhere)."""
        ...

    def predict(self, texts: Sequence[str], budget: float) -> BatchResult:
        """Classify ``texts`` (padded to the longest in the batch) running only the heads ``budget`` buys: what
        ``run(texts, Fixed(budget))`` runs, kept for callers that sweep numbers (CLI, benchmarks, evaluation)."""
        ...

    def run(self, texts: Sequence[str], request: Runnable, tokens: Tokens | None = None) -> BatchResult:
        """Classify ``texts`` as ``request`` asks, resolved by ``info.resolve``: ``Fixed`` runs ``predict``;
        ``Auto`` runs through the checkpoint's decider (``info.decider``), or on a type that predicts its own
        budget is ``predict`` capped at the ceiling (BudgetError on a checkpoint with neither). Under a decider
        each text runs at the budgets it picks for that text, the sum of its passes never above one pass at the
        ceiling; ``target`` selects the operating point calibrated for that mean cost (None: the default one).
        Each Prediction then says the budget it ended at (``budget_chosen``), every pass it ran (``passes``), and
        costs their sum; the ceiling is the budget every text ran under. ``tokens``: the texts as this engine's
        Meter tokenized them (``Meter.tokenize``), run as they are instead of tokenizing the texts again."""
        ...

    def warmup(self) -> None:
        """Build and touch every graph/session the budget grid needs, so first requests are not slow."""
        ...

    def reload_decider(self) -> ModelInfo:
        """Read the checkpoint's decider.json again (one `headbudget decider` made after start-up): ``Auto`` runs
        through it from the next batch on. A file that is missing or unusable leaves the running decider as it is.
        Returns ``info`` from now on. Safe from any thread (``info`` is replaced whole)."""
        ...

    def close(self) -> None:
        """Release sessions and threads."""
        ...


class TokenEngine(Engine, Protocol):
    """An Engine that also runs token ids it is given, below the texts: what benchmarks, evaluation and the
    decider's calibration drive. Every backend (engine/base.py ``EngineBase``) is one; ``load_engine`` returns it."""

    cfg: ModelConfig
    shape: Shape
    encoder: TextEncoder  # the engine's own tokenizer: its ``pad_id`` pads the ids these methods take

    def predict_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray, budget: float) -> np.ndarray:
        """Logits (B, C) for padded int64 ids and their mask (B, N) at ``budget`` (InputError on a bad shape)."""
        ...

    def forward_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray, plan: ExecutionPlan) -> np.ndarray:
        """Logits (B, C) running ``plan`` as it is, unchecked: any plan, not only a budget's."""
        ...

    def forward_rows(self, rows: Sequence[Sequence[int]], plan: ExecutionPlan) -> tuple[np.ndarray, int]:
        """Logits (B, C) for unpadded token ids, in passes under ``max_activation_bytes``, and the tokens those
        passes ran, padding included."""
        ...
