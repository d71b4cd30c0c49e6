"""Plain data passed across the engine interface (no torch, no onnxruntime types)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from headbudget.engine.artifacts import BenchRecord, SweepRecord
from headbudget.engine.budget_request import Auto, BudgetRequest, Fixed, LatencyTarget, Runnable
from headbudget.engine.decider import DECIDER_FILE, Decider
from headbudget.engine.errors import BudgetError
from headbudget.engine.names import DEFAULT_PRECISION, Backend, Precision
from headbudget.models.plan import Cost, ExecutionPlan  # re-exported: the engine interface speaks plans

__all__ = ["DEFAULT_PRECISION", "Auto", "Backend", "BatchResult", "BenchRecord", "BudgetRequest", "Cost", "Decider",
           "EngineOptions", "ExecutionPlan", "Fixed", "LatencyTarget", "ModelInfo", "Precision", "Prediction", "Runnable",
           "SweepRecord", "Tokens"]



@dataclass(frozen=True)
class EngineOptions:
    """How to run a checkpoint; parsed once at the edge (CLI, settings) and passed in."""

    backend: Backend = "onnxruntime"
    precision: Precision = "fp32"
    threads: int = 1  # intra-op threads per engine instance; scale out with workers, not threads
    max_length: int | None = None  # token limit; None = the model's max_position
    # ORT weight prepacking: on, the feed-forward and full-width attention weights are packed once (faster
    # matmuls, some memory); off, every matmul packs its weights on every call (slower).
    prepack: bool = True
    # Budgets that get a session of their own with every weight prepacked (ONNX Runtime, prepack on). The
    # one all-budget session packs a partial layer's weight slices on every call (docs/results.md, 'Every budget
    # costs what it says'); a budget served often (a tier's default) earns its own packed copy: about its share
    # of the layer weights in memory. The service passes its tiers' defaults.
    prepacked_budgets: tuple[float, ...] = (0.25, 0.5)
    cache_dir: Path | None = None  # where built ONNX graphs go; None = <checkpoint>/onnx
    # The most activation memory one forward pass may take, as engine/passes.py estimates it: a batch above it
    # runs in several passes (outputs per text unchanged in fp32). None: every batch in one pass.
    max_activation_bytes: int | None = None


@dataclass(frozen=True)
class Tokens:
    """Texts as a Meter tokenized them (``Meter.tokenize``): each one's token ids after truncation, and whether it
    was cut; what ``Engine.run`` takes instead of tokenizing the texts again."""

    ids: list[list[int]]
    truncated: list[bool]

    def counts(self) -> list[tuple[int, bool]]:
        """(tokens after truncation, truncated?) per text."""
        return [(len(ids), cut) for ids, cut in zip(self.ids, self.truncated, strict=True)]


@dataclass(frozen=True)
class Prediction:
    """One text's answer."""

    label: str
    scores: dict[str, float]  # label -> probability
    logits: list[float]
    n_tokens: int
    truncated: bool
    cost: Cost
    # The budget that ran is the batch's (BatchResult.budget; for a type that chooses per input, the cap of that
    # choice). A type that predicts its own budget says here what it chose for this input: BudgetFormer, the
    # fraction of heads it ran, within the cap. None for the others (span and AdaAttention report what they
    # saved in ``cost``). With a decider (``Engine.run`` with ``Auto``), the budget it chose for this text: that
    # of the pass whose answer this is.
    budget_chosen: float | None = None
    # Only under a decider's ``Auto``: every pass the text ran, in order; ``cost`` sums them all (a cascade's cheap
    # pass included), and the ceiling of the ``Auto`` bounds that sum.
    passes: tuple[float, ...] = ()


@dataclass(frozen=True)
class BatchResult:
    """Answers for one batch that ran under one head mask."""

    predictions: list[Prediction]
    budget: float  # the budget the mask was made for (a decider's Auto: the ceiling; each text says what it ran)
    heads_active: int
    heads_total: int
    latency_s: float  # wall time of the forward pass (tokenization excluded)
    tokens_run: int = 0  # tokens its passes ran, padding included (0: a backend that does not count them)


@dataclass(frozen=True)
class ModelInfo:
    """What the service shows about the loaded checkpoint."""

    name: str
    checksum: str  # sha256 of model.safetensors
    labels: tuple[str, ...]
    n_layers: int
    n_heads: int
    max_length: int
    model_type: str = "budgeted"
    # budget=auto: BudgetFormer predicts its own budget (a number is a cap there; ``decider`` is None), a
    # budgeted checkpoint with a decider.json beside it runs auto through that decider (``resolve``).
    supports_auto: bool = False
    decider: Decider | None = None
    sweep: SweepRecord | None = None  # sweep.json, if the checkpoint has a usable one
    bench: BenchRecord | None = None  # bench.json, if the checkpoint has a usable one
    extra: dict[str, Any] = field(default_factory=dict)

    @overload
    def resolve(self, request: Runnable) -> Runnable: ...
    @overload
    def resolve(self, request: BudgetRequest) -> BudgetRequest: ...

    def resolve(self, request: BudgetRequest) -> BudgetRequest:
        """What this checkpoint runs for ``request``: ``Auto`` as is where a decider serves it; on a type that
        predicts its own budget, a ``Fixed`` cap at the ceiling (every budget is a cap there); BudgetError where
        the checkpoint has no auto. ``Fixed`` and ``LatencyTarget`` as they are."""
        if not isinstance(request, Auto) or self.decider is not None:
            return request
        if self.supports_auto:
            return Fixed(request.ceiling)
        raise BudgetError(f"budget=auto: checkpoint {self.name!r} has no decider ({DECIDER_FILE}; make one with "
                          "`headbudget decider`)")
