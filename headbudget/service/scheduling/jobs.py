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
    latency_s: float  # forward pass of the batch (a request run in parts: all its passes)
    queue_s: float  # wait before the batch started
    degraded: bool
    auto: bool = False  # ran as an Auto, through the checkpoint's decider: metrics label it "auto"
    pass_s: tuple[float, ...] = ()  # a request run in parts: the forward pass each text ran in (else latency_s)


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
    # A request over one pass (ServerConfig.max_pass_ms) is queued as parts, each a Job of some of its texts in
    # order; the request's own Job waits on their results.
    parts: list[Job] = field(default_factory=list)
    parent: Job | None = None
    answered: dict[int, JobResult] = field(default_factory=dict)  # part index -> its result (on the parent)
    index: int = 0  # a part's place among its parent's parts

    def order(self) -> tuple[int, int, int]:
        """Sort key of the service order: priority first, then the keys' fair share of compute, then arrival."""
        return (-self.tier.priority, self.start_tag, self.seq)

    @property
    def request_job(self) -> Job:
        """The Job of the request this one serves: its parent, or itself."""
        return self.parent or self


def joined(parts: list[JobResult]) -> JobResult:
    """One request's result from its parts' (in order): their predictions, the lowest budget any part ran at, the
    engine time of all its passes and the pass each text ran in, and the wait before its first."""
    low = min(parts, key=lambda r: r.budget_applied)
    return JobResult(predictions=[p for r in parts for p in r.predictions], budget_requested=parts[0].budget_requested,
                     budget_applied=low.budget_applied, heads_active=low.heads_active, heads_total=low.heads_total,
                     latency_s=sum(r.latency_s for r in parts), queue_s=parts[0].queue_s,
                     degraded=any(r.degraded for r in parts), auto=parts[0].auto,
                     pass_s=tuple(r.latency_s for r in parts for _ in r.predictions))

