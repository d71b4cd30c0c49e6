"""A request waiting for the model (``Job``) and what the engine answered for it (``JobResult``).

Admission (``batching.Batcher.submit``) makes a Job, the planner reads it, the engine thread answers it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from headbudget.engine.types import BudgetRequest, Prediction, Tokens
from headbudget.service.settings import TierConfig

_seq = itertools.count()


@dataclass(frozen=True)
class JobResult:
    """What the engine answered for one request."""

    predictions: list[Prediction]
    budget_requested: float
    budget_applied: float
    heads_active: int
    heads_total: int
    latency_s: float  # forward pass of the batch
    queue_s: float  # wait before the batch started
    degraded: bool
    auto: bool = False  # ran as an Auto, through the checkpoint's decider: metrics label it "auto"


@dataclass(eq=False)
class Job:
    """One request waiting for the model."""

    texts: list[str]
    tier: TierConfig
    # What it asked for, as the checkpoint runs it (ModelInfo.resolve): an Auto here goes through a decider; on a
    # type that predicts its own budget, auto is already a Fixed cap at its ceiling.
    request: BudgetRequest
    tokens: int  # its texts' own tokens, what it runs (estimated from their characters until counted)
    future: asyncio.Future[JobResult]
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)
    seq: int = field(default_factory=lambda: next(_seq))
    cancelled: bool = False
    counted: bool = False  # tokens exact (counted by the engine)
    alone: bool = False  # it found the model idle: nothing waiting, no forward pass running
    cost_cache: dict[float, float] = field(default_factory=dict)
    owner: str = ""  # the key's id (Caller.owner): compute is shared fairly between the keys of a priority
    charge: int = 0  # milli compute units it is expected to run: its weight in that sharing
    start_tag: int = 0  # its virtual start (FairShare): set at admission
    token_ids: Tokens | None = None  # its texts' token ids, where admission priced it (Quote)
    tokenize_cpu_s: float = 0.0  # CPU time tokenizing them took

    def order(self) -> tuple[int, int, int]:
        """Sort key of the service order: priority first, then the keys' fair share of compute, then arrival."""
        return (-self.tier.priority, self.start_tag, self.seq)

