"""The queue in front of the model: admission, tier priority, degrade-by-compute and micro-batching.

One dedicated thread owns the engine (it loads, warms up, runs and closes it), takes the first waiting request
in service order (priority, then the keys' fair share of compute: ``planner.FairShare``), waits up to
``max_wait_ms`` for others that share its head mask (not at all for a request that found the model idle: batching
must not tax an idle server), and runs them as one batch. Budgets are chosen at dispatch (see ``planner.py``).
The engine runs on its own thread, not the event loop's, so that a burst reaches the priority queue as it arrives.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from headbudget.engine.errors import EngineError
from headbudget.engine.protocol import Engine, Meter
from headbudget.engine.types import Auto, BatchResult, BudgetRequest, LatencyTarget, ModelInfo, Tokens
from headbudget.service.accounting.compute import ComputeUnit, Quote, units
from headbudget.service.errors import Overloaded
from headbudget.service.metrics import Metrics
from headbudget.service.scheduling.jobs import Job, JobResult, joined
from headbudget.service.scheduling.latency import LatencyModel
from headbudget.service.scheduling.planner import FairShare, Planner
from headbudget.service.settings import ServerConfig, TierConfig

log = logging.getLogger("headbudget.service")


class Batcher:
    """Owns the engine thread and the queue; every method except the worker runs on the event loop."""

    def __init__(self, engine_factory: Callable[[], Engine], server: ServerConfig, metrics: Metrics) -> None:
        self._factory = engine_factory
        self.server = server
        self._metrics = metrics
        self._cond = threading.Condition()
        self._pending: list[Job] = []
        # Requests waiting, counted as jobs enter and leave (a request queued as parts counts once): admission
        # reads the counts instead of scanning the queue for every request
        self._parts_waiting: dict[int, int] = {}  # id of a request's Job -> its parts in the queue
        self._tier_waiting: Counter[str] = Counter()  # tier -> its requests in the queue
        self._fair = FairShare()  # under _cond, like _pending
        self._stopping = False
        self._running_until = 0.0  # monotonic estimate of when the running batch ends
        self._forwarding = False  # a batch left the queue and its forward pass has not finished
        self._thread = threading.Thread(target=self._run, name="headbudget-engine", daemon=True)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.engine: Engine | None = None
        self.meter: Meter | None = None  # prices requests at admission, off this thread (engine/protocol.py)
        self._unit: ComputeUnit | None = None  # for the compute that degraded requests did not get
        self.latency: LatencyModel | None = None
        self.planner: Planner | None = None
        self.ready = False

    # -- lifecycle (event loop) -------------------------------------------------------------------------
    async def start(self) -> ModelInfo:
        """Load and warm up the engine in its thread; raises what loading raised."""
        self._thread.start()
        await asyncio.get_running_loop().run_in_executor(None, self._started.wait)
        if self._start_error is not None:
            raise self._start_error
        assert self.engine is not None
        return self.engine.info

    async def stop(self) -> None:
        """Answer everything queued, then close the engine and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def depth(self) -> int:
        """Requests waiting (a request queued as parts counts once)."""
        return len(self._parts_waiting)

    # -- admission (event loop) -------------------------------------------------------------------------
    def submit(self, texts: list[str], tier: TierConfig, request: BudgetRequest, owner: str = "",
               priced: Quote | None = None) -> Job:
        """Queue a request or raise Overloaded (503 with Retry-After) when it cannot be served in time.

        ``owner`` is the caller's key id and ``priced`` the request's Quote, if admission priced it: its charge in
        milli compute units (else estimated here) weighs it as the keys of a priority share the model by compute
        (FairShare), its token counts are exact, and the engine runs its token ids.

        An ``Auto`` request runs under its ceiling. On a checkpoint with a decider such jobs run as one ``Auto``
        and batch only with each other; on one that predicts its own budget (BudgetFormer) the ceiling is a cap
        like any numeric budget and they batch with numeric jobs of the same plan.
        """
        job = self._new_job(texts, tier, request, owner, priced)
        job.parts = self._split(job)
        with self._cond:
            self._check_room(tier)
            job.start_tag = self._fair.start(job)  # where it would stand in the service order
            if tier.degrades:
                self._check_in_time(job, list(self._pending))
            # Idle means no queue and no forward pass, not "no recent arrival": a client that sends its next
            # request as soon as its answer comes (batch 1) never waits a batch window, whatever its round trip.
            job.alone = not self._pending and not self._forwarding
            for queued in job.parts or [job]:  # parts in order: each starts where its key's previous one ends
                queued.alone = job.alone
                self._fair.admit(queued)
                self._enqueue(queued)
            self._metrics.queue_depth.set(self.depth)
            self._cond.notify_all()
        return job

    def precheck(self, texts: list[str], tier: TierConfig, request: BudgetRequest, owner: str, floor: Quote) -> None:
        """Overloaded now, before the request is tokenized, where ``submit`` would refuse it even at its ``floor``
        price: the floor's tokens are at most its own, so what the floor cannot fit in the queue or the tier's
        latency target, the exact price cannot either."""
        job = self._new_job(texts, tier, request, owner, floor)
        with self._cond:
            self._check_room(tier)
            if tier.degrades:
                job.start_tag = self._fair.start(job)
                self._check_in_time(job, list(self._pending))

    def _split(self, job: Job) -> list[Job]:
        """``job``'s texts in order as parts of at most one pass each; none when it fits in one pass, or asks for
        a latency target (its budget is chosen for the request as a whole)."""
        assert self.latency is not None and self.planner is not None
        budget, limit_ms = self.planner.stated(job), self.server.max_pass_ms
        if len(job.texts) < 2 or isinstance(job.request, LatencyTarget) or \
                self.latency.estimate_ms(budget, job.tokens) <= limit_ms:
            return []
        ids = job.token_ids
        tokens = [len(t) for t in ids.ids] if ids is not None else \
            [self.latency.estimate_tokens([text]) for text in job.texts]
        cuts, run = [0], 0
        for i, n in enumerate(tokens):
            if i > cuts[-1] and self.latency.estimate_ms(budget, run + n) > limit_ms:
                cuts.append(i)
                run = 0
            run += n
        cuts.append(len(tokens))
        total = max(1, sum(tokens))
        parts = []
        for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            part = Job(job.texts[a:b], job.tier, job.request, sum(tokens[a:b]), job.loop.create_future(), job.loop,
                       counted=job.counted, owner=job.owner, charge=job.charge * sum(tokens[a:b]) // total,
                       token_ids=Tokens(ids.ids[a:b], ids.truncated[a:b]) if ids is not None else None,
                       tokenize_cpu_s=job.tokenize_cpu_s if k == 0 else 0.0, parent=job, index=k)
            parts.append(part)
        return parts

    def _new_job(self, texts: list[str], tier: TierConfig, request: BudgetRequest, owner: str,
                 priced: Quote | None) -> Job:
        """The request as a Job: with the tokens and charge admission priced, or with both estimated here."""
        assert self.engine is not None and self.latency is not None
        loop = asyncio.get_running_loop()
        resolved = self.engine.info.resolve(request)
        if priced is None:
            job = Job(texts, tier, resolved, self.latency.estimate_tokens(texts), loop.create_future(), loop,
                      owner=owner)
            job.charge = self._estimate_charge(job)
            return job
        return Job(texts, tier, resolved, sum(n for n, _ in priced.tokens), loop.create_future(), loop,
                   counted=True, owner=owner, charge=priced.total, token_ids=priced.token_ids,
                   tokenize_cpu_s=priced.tokenize_cpu_s)

    def _check_room(self, tier: TierConfig) -> None:
        """Overloaded when the server is stopping or the queue, or the tier's share of it, is full (under _cond)."""
        if self._stopping:
            raise Overloaded("the server is shutting down", retry_after_s=1)
        if len(self._parts_waiting) >= self.server.queue_size:
            raise Overloaded("the queue is full", retry_after_s=self._drain_s(self._pending))
        if self._tier_waiting[tier.name] >= tier.max_queue:
            raise Overloaded(f"the queue of tier {tier.name!r} is full", retry_after_s=self._drain_s(self._pending))

    def _enqueue(self, job: Job) -> None:
        """Put ``job`` in the queue and count its request (under _cond)."""
        self._pending.append(job)
        key = id(job.request_job)
        parts = self._parts_waiting.get(key, 0)
        if not parts:
            self._tier_waiting[job.tier.name] += 1
        self._parts_waiting[key] = parts + 1

    def _dequeue(self, job: Job) -> None:
        """Take ``job`` out of the queue; its request leaves the counts with its last part (under _cond)."""
        self._pending.remove(job)
        key = id(job.request_job)
        parts = self._parts_waiting[key] - 1
        if parts:
            self._parts_waiting[key] = parts
        else:
            del self._parts_waiting[key]
            self._tier_waiting[job.tier.name] -= 1

    def _check_in_time(self, job: Job, pending: list[Job]) -> None:
        """Overloaded when a degrading tier's request would miss its latency target even if every request ahead
        of it ran at its tier's min_budget (under _cond, with ``job``'s start tag set)."""
        assert self.planner is not None
        tier = job.tier
        # Only work queued ahead can make a request too late to take. The running pass is not counted: a retry
        # could not start before it ends either, and the fair order puts short requests ahead of a heavy key's
        # backlog, so they wait for that pass alone.
        ahead_s = self.planner.wait_at_floor_s(pending, job)
        own_s = self.planner.cost_s(job, tier.floor_budget)
        assert tier.latency_target_ms is not None
        if ahead_s > 0 and (ahead_s + own_s) * 1000 > tier.latency_target_ms:
            raise Overloaded(
                f"even min_budget {tier.floor_budget} cannot meet tier {tier.name!r}'s latency target of "
                f"{tier.latency_target_ms:g} ms now", retry_after_s=self._running_left() + ahead_s)

    def cancel(self, job: Job) -> None:
        """Drop a job whose client went away (a running batch still finishes; its answer is discarded)."""
        with self._cond:
            for queued in reversed(job.parts or [job]):  # the latest first: each gives its key's time back
                queued.cancelled = True
                if queued in self._pending:
                    self._dequeue(queued)
                    self._fair.withdraw(queued)
            self._metrics.queue_depth.set(self.depth)

    def _set_idle(self) -> None:
        with self._cond:
            self._forwarding = False

    def _running_left(self) -> float:
        return max(0.0, self._running_until - time.monotonic())

    def _estimate_charge(self, job: Job) -> int:
        """Milli compute units of ``job`` at its stated budget on its estimated tokens, for a request that
        admission did not price."""
        assert self.meter is not None and self._unit is not None and self.planner is not None
        per_text = job.tokens // len(job.texts) if job.texts else 0
        return len(job.texts) * self._unit.milli(self.meter.cost(self.planner.stated(job), per_text).total_macs)

    def _drain_s(self, pending: list[Job]) -> float:
        assert self.planner is not None
        return self._running_left() + sum(self.planner.cost_s(j, self.planner.stated(j)) for j in pending)

    # -- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._factory()
            engine.warmup()
            self.meter = engine.meter()
            self._unit = ComputeUnit.of(self.meter)
            self.engine = engine
            self.latency = LatencyModel(engine.info.bench, engine.info.max_length)
            self.planner = Planner(engine, self.latency)
            self.ready = True
        except BaseException as e:  # noqa: BLE001 - handed to start() and raised there
            self._start_error = e
            return
        finally:
            self._started.set()
        try:
            while self._serve_one_batch():
                pass
        finally:
            self.ready = False
            engine.close()

    def _serve_one_batch(self) -> bool:
        """Wait for work, run one batch; False once stopping and nothing is left."""
        assert self.engine is not None and self.planner is not None
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait()
            if not self._pending:
                return False
            head = min(self._pending, key=Job.order)
            # An isolated request runs at once; under concurrent arrivals the batch waits for company.
            lone = head.alone and len(self._pending) == 1
            window_end = head.enqueued + (0.0 if lone else self.server.max_wait_ms / 1000.0)
            while not self._stopping and time.monotonic() < window_end and \
                    sum(len(j.texts) for j in self._pending) < self.server.max_batch_size:
                self._cond.wait(max(0.0, window_end - time.monotonic()))
            self._expire_locked()
            snapshot = sorted(self._pending, key=Job.order)  # _expire_locked took the cancelled out
        if not snapshot:
            return True
        self._count_tokens(snapshot)
        batch, applied, wants = self.planner.plan(snapshot, time.monotonic(), self.server.max_batch_size,
                                                  self.server.max_pass_ms / 1000.0)
        budget = applied[batch[0].seq]
        with self._cond:
            batch = [j for j in batch if not j.cancelled and j in self._pending]
            for j in batch:
                self._dequeue(j)
            self._fair.served(batch)
            self._metrics.queue_depth.set(self.depth)
            if batch:
                self._running_until = time.monotonic() + sum(self.planner.cost_s(j, budget) for j in batch)
                # Set with the batch's removal, under the lock: a request submitted in between must not find
                # the model idle while this batch is about to run.
                self._forwarding = True
        if batch and (done := self._run_batch(batch, budget, applied, wants)) is not None:
            done()
        return True

    def _expire_locked(self) -> None:
        """Answer 503 to what waited too long, and drop the parts of a request that failed or went away."""
        now = time.monotonic()
        gone = [j for j in self._pending if j.cancelled or now - j.enqueued > self.server.request_timeout_s]
        for job in reversed(gone):  # the latest first: each gives its key's time back (as ``cancel``)
            self._dequeue(job)
            self._fair.withdraw(job)
            if not job.cancelled:
                _deliver(job, Overloaded("timed out waiting for the model", retry_after_s=1))
        if gone:  # a gauge write is a lock and, with several workers, a shared file's: only on a change
            self._metrics.queue_depth.set(self.depth)

    def _count_tokens(self, jobs: list[Job]) -> None:
        """Exact token counts for the requests whose budget depends on their length."""
        assert self.engine is not None
        for job in jobs:
            if isinstance(job.request, LatencyTarget) and not job.counted:
                job.tokens = sum(n for n, _ in self.engine.count_tokens(job.texts))
                job.counted = True
                job.cost_cache.clear()

    def _run_batch(self, batch: list[Job], budget: float, applied: dict[int, float],
                   wants: dict[int, float]) -> Callable[[], None] | None:
        """Run and answer a batch; returns its bookkeeping (the latency model) to call after the answers."""
        assert self.engine is not None and self.latency is not None
        texts = [t for j in batch for t in j.texts]
        request = batch[0].request.at(budget)  # the planner batches Auto jobs only with Auto jobs of one ceiling
        auto = isinstance(request, Auto)
        tokens, tokenize_cpu_s = _tokens(batch)
        started, cpu_started = time.monotonic(), time.thread_time()
        try:
            result = self.engine.run(texts, request, tokens)
        except Exception as e:  # noqa: BLE001 - a bug must fail these requests, not the thread
            self._set_idle()
            if not isinstance(e, EngineError):
                log.exception("engine failed on a batch")
            _deliver_all([(job, e) for job in batch])
            return None
        # The engine's CPU includes tokenizing the batch, which admission did for the priced requests
        wall, cpu = time.monotonic() - started, time.thread_time() - cpu_started + tokenize_cpu_s
        # Idle before the first answer leaves this thread: the event loop may hand a client its answer and take
        # that client's next request before this thread runs again, and that request must find the model idle.
        self._set_idle()
        # The batch's metrics before its answers: a client that reads /metrics right after its answer sees the
        # pass that made it.
        own = sum(p.n_tokens * len(p.passes or (0,)) for p in result.predictions)  # a decider's auto: every pass
        self._metrics.observe_batch(budget, wall, len(texts), cpu, auto=auto,
                                    tokens=(own, max(0, result.tokens_run - own) if result.tokens_run else 0))
        self._answer(batch, result, applied, wants, started, auto)
        # The latency model learns after the answers, which need not wait for it
        return functools.partial(_learn_latency, self.latency, texts, result, budget, wall * 1000, auto)

    def _answer(self, batch: list[Job], result: BatchResult, applied: dict[int, float], wants: dict[int, float],
                started: float, auto: bool) -> None:
        """Hand each job its texts' predictions (in one wake-up of the event loop), and count the compute that
        degrading took from it."""
        offset, outcomes = 0, []
        for job in batch:
            preds = result.predictions[offset:offset + len(job.texts)]
            offset += len(job.texts)
            want, mine = wants[job.seq], applied[job.seq]
            if mine < want:  # the autoscaler's signal: what degrading took from this request
                assert self.meter is not None and self._unit is not None
                self._metrics.observe_degraded_compute(
                    job.tier.name, degraded_units(self.meter, self._unit, want, mine, [p.n_tokens for p in preds]))
            outcomes.append((job, JobResult(
                predictions=preds, budget_requested=want, budget_applied=mine,
                heads_active=result.heads_active, heads_total=result.heads_total, latency_s=result.latency_s,
                queue_s=started - job.enqueued, degraded=mine < want, auto=auto)))
        _deliver_all(outcomes)


def _learn_latency(latency: LatencyModel, texts: list[str], result: BatchResult, budget: float, wall_ms: float,
                   auto: bool) -> None:
    """Update the latency model with a batch's time and its texts' token counts."""
    # The engine runs a batch in passes by length, so its time follows the tokens those ran
    ran = result.tokens_run or len(texts) * max((p.n_tokens for p in result.predictions), default=1)
    if not auto:  # an auto batch ran several budgets: its time is no sample of one budget's latency
        latency.observe(budget, ran, wall_ms)
    for text, pred in zip(texts, result.predictions, strict=True):
        if not pred.truncated:
            latency.observe_text(len(text), pred.n_tokens)


def _tokens(batch: Sequence[Job]) -> tuple[Tokens | None, float]:
    """The batch's token ids where admission tokenized every request of it, and the CPU time that took; else
    (None, 0): the engine tokenizes the batch (requests of an unmetered tier share batches with priced ones)."""
    if len(batch) == 1:
        return batch[0].token_ids, batch[0].tokenize_cpu_s  # 0.0 where admission did not tokenize
    parts = [j.token_ids for j in batch]
    if any(e is None for e in parts):
        return None, 0.0
    return (Tokens([ids for e in parts if e is not None for ids in e.ids],
                    [cut for e in parts if e is not None for cut in e.truncated]),
            sum(j.tokenize_cpu_s for j in batch))


def degraded_units(meter: Meter, unit: ComputeUnit, want: float, applied: float, tokens: Sequence[int]) -> float:
    """Compute units that texts of ``tokens`` tokens asked for at budget ``want`` and did not get at ``applied``:
    the two plans' multiply-adds apart (for a type that picks its own heads, or a decider's auto, the caps')."""
    macs = sum(meter.cost(want, n).total_macs - meter.cost(applied, n).total_macs for n in tokens)
    return units(unit.milli(max(0, macs)))


def _deliver(job: Job, outcome: JobResult | BaseException) -> None:
    """Hand a result or error to the waiting coroutine, from the engine thread."""
    _deliver_all([(job, outcome)])


def _deliver_all(outcomes: Sequence[tuple[Job, JobResult | BaseException]]) -> None:
    """Hand a batch's results or errors to their waiting coroutines, from the engine thread: one callback on the
    event loop for the whole batch (one wake-up, not one a request)."""
    if not outcomes:
        return

    def _set() -> None:
        for job, outcome in outcomes:
            if job.parent is not None:
                _part_done(job, job.parent, outcome)
            elif job.future.done():
                continue
            elif isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

    try:
        outcomes[0][0].loop.call_soon_threadsafe(_set)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _part_done(part: Job, request: Job, outcome: JobResult | BaseException) -> None:
    """A part's answer, on the event loop: the request's once every part has one, or the first part's error (its
    other parts are then dropped from the queue)."""
    if request.future.done():
        return
    if isinstance(outcome, BaseException):
        for other in request.parts:
            other.cancelled = True
        request.future.set_exception(outcome)
        return
    request.answered[part.index] = outcome
    if len(request.answered) == len(request.parts):
        request.future.set_result(joined([request.answered[i] for i in range(len(request.parts))]))
