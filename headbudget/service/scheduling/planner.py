"""Which budget each waiting request runs at, and which requests share the next batch.

At every dispatch the planner (1) resolves each request's wanted budget (its own, or for ``max_latency_ms``
the highest grid budget whose estimated latency for its input fits the time left), then (2) finds the highest
*degrade level* L such that, serving the queue in order with every degrading tier's requests capped at
max(L, min_budget), each of them still meets its tier's latency target; L = the lowest grid budget when none
does. Lowering the queue's budgets shortens every later request's wait: that is how load is shed by
compute before it is refused. (3) The head request and the following ones with the same mask key form the
batch.

On checkpoints that predict their own budget per text (BudgetFormer) every budget is a cap. A ``budget=auto``
request wants the cap of its tier's max_budget (1.0: no cap) and degrades like any other: under load its cap
is lowered to the level (never below min_budget), so each text runs min(its own budget, the cap). Its
latency is estimated at the cap, an upper bound that the observed batch times correct.

On a budgeted checkpoint with a decider, a ``budget=auto`` request (an ``Auto`` job) wants its ceiling (the
request's max_budget, else its tier's max_budget), degrades the same way (a lower ceiling), and batches only with
auto requests of the same ceiling: the engine runs them as one ``Auto``, each text at its own budgets. Its latency
is estimated at the ceiling, an upper bound (all its passes together never cost more than one pass there).
(On a checkpoint that predicts its own budget, the job already holds auto as a cap: ``ModelInfo.resolve``.)

The service order is priority first, then, within a priority, start-time fair queueing over compute between the
keys (``FairShare``), then arrival.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from headbudget.engine.protocol import Engine
from headbudget.engine.types import Auto
from headbudget.service.scheduling.jobs import Job
from headbudget.service.scheduling.latency import LatencyModel


class Planner:
    """Budget choices over the queue; runs on the engine thread (and, read-only, at admission)."""

    def __init__(self, engine: Engine, latency: LatencyModel) -> None:
        self._engine = engine
        self._latency = latency
        self.grid = latency.grid()
        self._allowed: dict[float, list[float]] = {}  # a tier's max_budget -> the grid budgets up to it

    def cost_s(self, job: Job, budget: float) -> float:
        """Estimated seconds to run ``job`` alone at ``budget``."""
        cached = job.cost_cache.get(budget)
        if cached is None:
            cached = job.cost_cache[budget] = self._latency.estimate_ms(budget, job.tokens) / 1000.0
        return cached

    def want(self, job: Job, now: float) -> float:
        """The budget a request asks for, before any degradation (a latency target: among the grid budgets up to
        its tier's maximum)."""
        allowed = self._allowed.get(job.tier.max_budget)
        if allowed is None:
            allowed = self._allowed[job.tier.max_budget] = \
                [b for b in self.grid if b <= job.tier.max_budget + 1e-9] or [self.grid[0]]
        return job.request.want(now - job.enqueued, allowed, lambda b: self.cost_s(job, b))

    @staticmethod
    def stated(job: Job) -> float:
        """The budget a request states before it is planned (``BudgetRequest.stated``, a latency target's being
        its tier's default)."""
        return job.request.stated(job.tier.default_cap)

    def wait_at_floor_s(self, pending: Sequence[Job], job: Job) -> float:
        """Seconds of work queued ahead of ``job`` if every degrading request ran at its tier's minimum."""
        total = 0.0
        for other in pending:
            if other.order() < job.order():
                floor = other.tier.floor_budget if other.tier.degrades else None
                want = self.stated(other)
                total += self.cost_s(other, min(want, floor) if floor is not None else want)
        return total

    def key(self, job: Job, budget: float) -> Hashable:
        """Jobs whose keys are equal at their budgets may share a batch: the plan's key, or for a decider's auto
        the request under that ceiling (texts run their own plans within it)."""
        return job.request.at(budget) if isinstance(job.request, Auto) else self._engine.plan(budget).key

    def _effective(self, job: Job, want: float, level: float | None) -> float:
        if level is None or not job.tier.degrades:
            return want
        budget = min(want, max(level, job.tier.floor_budget))
        return want if self.key(job, budget) == self.key(job, want) else budget

    def _meets_targets(self, jobs: Sequence[Job], wants: dict[int, float], level: float, now: float) -> bool:
        elapsed = 0.0
        for job in jobs:
            elapsed += self.cost_s(job, self._effective(job, wants[job.seq], level))
            target = job.tier.latency_target_ms
            if target is not None and (now - job.enqueued + elapsed) * 1000.0 > target:
                return False
        return True

    def degrade_level(self, jobs: Sequence[Job], wants: dict[int, float], now: float) -> float | None:
        """The highest grid budget that lets every degrading request meet its target (None: no cap)."""
        if not any(j.tier.degrades for j in jobs):
            return None
        if self._meets_targets(jobs, wants, 1.0, now):
            return None
        lo, hi = 0, len(self.grid) - 1  # invariant: grid[hi] fails; find the highest index that passes
        if not self._meets_targets(jobs, wants, self.grid[0], now):
            return self.grid[0]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._meets_targets(jobs, wants, self.grid[mid], now):
                lo = mid
            else:
                hi = mid
        return self.grid[lo]

    def plan(self, jobs: Sequence[Job], now: float, max_batch: int, max_pass_s: float = math.inf
             ) -> tuple[list[Job], dict[int, float], dict[int, float]]:
        """(the next batch, applied budget per job seq, wanted budget per job seq); ``jobs`` in service order. A
        batch holds at most ``max_batch`` texts, and parts of requests split into passes (Job.parent) of at most
        ``max_pass_s`` of estimated work beyond its first job, and none behind a whole request: the queue is looked at
        again after each pass, while whole requests (each under one pass) batch as before."""
        wants = {j.seq: self.want(j, now) for j in jobs}
        level = self.degrade_level(jobs, wants, now)
        applied = {j.seq: self._effective(j, wants[j.seq], level) for j in jobs}
        head = jobs[0]
        key = self.key(head, applied[head.seq])
        batch, n_texts = [head], len(head.texts)
        parts_s = self.cost_s(head, applied[head.seq]) if head.parent is not None else 0.0
        for job in jobs[1:]:
            if n_texts + len(job.texts) > max_batch or self.key(job, applied[job.seq]) != key:
                continue
            if job.parent is not None:
                if head.parent is None:  # the whole requests ahead would wait for the part's pass
                    continue
                cost = self.cost_s(job, applied[job.seq])
                if parts_s + cost > max_pass_s:
                    continue
                parts_s += cost
            batch.append(job)
            n_texts += len(job.texts)
        return batch, applied, wants


class FairShare:
    """Start-time fair queueing (Goyal et al., 1996) over compute between the keys of one priority.

    Each request gets a start tag ``max(V, F_key)``, where ``F_key`` is where its key's previous request ends
    (start + charge, in milli compute units) and ``V``, the priority's virtual time, is the latest start tag
    served; requests of a priority are served by start tag. Two keys that both keep requests waiting are
    served equal compute, within the largest request of each, whatever their request sizes; a key that sends
    little starts at ``V`` and is served before the backlog of one that sends much; an idle key banks nothing.
    With one key waiting, tags grow with arrival: the plain arrival order. Why this scheme: tags are fixed at
    arrival, so admission can reckon the work ahead of a request from the same order the engine thread serves
    (``wait_at_floor_s``), and unlike deficit round robin it needs no quantum sized to the largest request.
    Tags are integers, so sums are exact and ties fall to arrival.
    """

    def __init__(self) -> None:
        self._clock: dict[int, int] = {}  # priority -> virtual time V
        self._finish: dict[tuple[int, str], int] = {}  # (priority, owner) -> F of its latest request

    def start(self, job: Job) -> int:
        """The start tag ``job`` would get now (nothing recorded: admission may still refuse it)."""
        v = self._clock.get(job.tier.priority, 0)
        return max(v, self._finish.get((job.tier.priority, job.owner), v))

    def admit(self, job: Job) -> None:
        """Tag ``job`` and record that its key's next request starts after it."""
        job.start_tag = self.start(job)
        self._finish[(job.tier.priority, job.owner)] = job.start_tag + job.charge

    def withdraw(self, job: Job) -> None:
        """A queued request that will not run (client gone, timed out): its key's latest one gives its time back."""
        key = (job.tier.priority, job.owner)
        if self._finish.get(key) == job.start_tag + job.charge:
            self._finish[key] = job.start_tag

    def served(self, batch: Sequence[Job]) -> None:
        """Advance the virtual time past the batch that leaves the queue; forget keys that would start at it."""
        for job in batch:
            p = job.tier.priority
            self._clock[p] = max(self._clock.get(p, 0), job.start_tag)
        for key in [k for k, f in self._finish.items() if f <= self._clock.get(k[0], 0)]:
            del self._finish[key]
