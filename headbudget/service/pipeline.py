"""The one pipeline of every route that classifies, from a parsed request to its answer: choose the budget,
admit and price, queue the texts, wait (or drop if the client leaves), charge, count and remember what ran.

/classify (its fast path and its FastAPI route) and TEI's /predict and / parse their own bodies into a ``Call``
and hand it to ``classify_call``; each shapes the ``Answered`` into its own body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, fields
from typing import Any

from starlette.requests import Request

from headbudget.engine.types import Auto, BudgetRequest, Fixed, LatencyTarget
from headbudget.service.accounting.auth import Caller, admit, check_budget
from headbudget.service.accounting.compute import Bill, Quote, bill, check_cap, floor_quote, quote, units
from headbudget.service.accounting.journal import Entry
from headbudget.service.errors import BadRequest, ClientGone, InvalidRequest, Unavailable
from headbudget.service.http.middleware import new_request_id
from headbudget.service.http.schemas import BudgetSource, ClassifyRequest
from headbudget.service.runtime import Runtime
from headbudget.service.scheduling.jobs import Job, JobResult
from headbudget.service.settings import AUTO, TierConfig
from headbudget.service.state.store import (
    AnswerRecord,
    ComputeLimit,
    StateUnavailable,
    Usage,
    UsageRow,
    utc_day,
)

log = logging.getLogger("headbudget.service")


@dataclass(frozen=True)
class BudgetParams:
    """The budget fields a request may give outside its body: query parameters (TEI: or headers)."""

    budget: float | str | None = None
    max_latency_ms: float | None = None
    max_budget: float | None = None


CLASSIFY_QUERY = tuple(f.name for f in fields(BudgetParams))  # /classify's query parameters


def check_query(pairs: Iterable[tuple[str, str]], known: Collection[str]) -> None:
    """422 unless every query parameter is one the route takes, given once: a misspelt budget would otherwise run
    (and be charged at) the tier's default, and a repeated one its last value, without a word."""
    seen: set[str] = set()
    for name, _ in pairs:
        if name not in known:
            raise InvalidRequest(f"query.{name[:64]}: not a parameter of this route (it takes {', '.join(known)})")
        if name in seen:
            raise InvalidRequest(f"query.{name}: given more than once")
        seen.add(name)


@dataclass(frozen=True)
class BudgetChoice:
    """What the request asked for (a budget, ``auto`` under a ceiling, or a latency target; the tier's default
    when it named none) and where that came from."""

    request: BudgetRequest
    source: BudgetSource

    @property
    def auto(self) -> bool:
        """Each text at its own budget (the checkpoint's or its decider's), within the ceiling."""
        return isinstance(self.request, Auto)

    @property
    def max_latency_ms(self) -> float | None:
        """The latency target, as the answer echoes it (None for a budget or auto)."""
        return self.request.max_latency_ms if isinstance(self.request, LatencyTarget) else None


def choose_budget(body: BudgetParams, params: BudgetParams, caller: Caller, supports_auto: bool,
                  decider_pending: bool = False) -> BudgetChoice:
    """Merge query (``params``) and body (else the tier default), check the tier's maximum (403), and reject auto
    where unsupported (400; 503 while the decider is being made). ``auto`` runs under a ceiling: the request's
    ``max_budget`` (403 above the tier's max_budget, like a budget), else the tier's max_budget."""
    if params.budget is not None and body.budget is not None:
        raise InvalidRequest("give budget in the query or in the body, not both")
    if params.max_latency_ms is not None and body.max_latency_ms is not None:
        raise InvalidRequest("give max_latency_ms in the query or in the body, not both")
    if params.max_budget is not None and body.max_budget is not None:
        raise InvalidRequest("give max_budget in the query or in the body, not both")
    budget = params.budget if params.budget is not None else body.budget
    latency = params.max_latency_ms if params.max_latency_ms is not None else body.max_latency_ms
    ceiling = params.max_budget if params.max_budget is not None else body.max_budget
    if budget is not None and latency is not None:
        raise InvalidRequest("give budget or max_latency_ms, not both")
    if latency is not None:
        if ceiling is not None:
            raise InvalidRequest("max_budget is the ceiling of budget=auto; with max_latency_ms it has no meaning")
        return BudgetChoice(LatencyTarget(latency), "max_latency_ms")
    source: BudgetSource = "request" if budget is not None else "tier_default"
    if budget is None:
        budget = caller.tier.default_budget
    if budget == AUTO:
        if not supports_auto and decider_pending:
            raise Unavailable("budget=auto is not ready yet: this server is making the checkpoint's decider "
                              "(about a minute after start-up)", retry_after_s=15)
        if not supports_auto:
            raise BadRequest("budget=auto needs a checkpoint that predicts its own budget or has a decider "
                             "(decider.json, made by `headbudget decider`); this one has neither")
        if ceiling is not None:
            check_budget(caller.tier, ceiling)
        return BudgetChoice(Auto(ceiling if ceiling is not None else caller.tier.max_budget), source)
    if isinstance(budget, str):
        raise InvalidRequest(f"budget must be a number in [0.1, 1] or 'auto', got {budget!r}")
    if ceiling is not None:
        raise InvalidRequest("max_budget is the ceiling of budget=auto; with a numeric budget, the budget is what runs")
    if source == "request":
        check_budget(caller.tier, budget)
    return BudgetChoice(Fixed(budget), source)


async def _wait(request: Request, job: Job) -> JobResult:
    """The job's result; ClientGone as soon as the client disconnects while it waits."""
    future = job.future
    if job.alone:
        # It found the model idle and runs at once: nothing to drop if its client leaves, so no watcher (a task,
        # its first step and its cancellation: the most of this function's cost for a batch-1 request).
        return await future

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher: asyncio.Future[None] = asyncio.ensure_future(disconnected())

    def gone(_: object) -> None:  # the watcher ended: the client left (unless the answer came first)
        if not future.done() and not watcher.cancelled():
            future.set_exception(ClientGone())

    # A done callback rather than asyncio.wait, which builds sets and a waiter future and adds and removes
    # callbacks on both every time (docs/results.md, 'The serving limit': the loop's steps).
    watcher.add_done_callback(gone)
    try:
        return await future
    finally:
        watcher.cancel()


@dataclass(frozen=True)
class Call:
    """One classification request as its route parsed it: what every route that classifies hands the pipeline."""

    texts: list[str]
    outside: BudgetParams  # the budget fields outside the body: query parameters (TEI: or headers)
    inside: BudgetParams = BudgetParams()  # the body's own (/classify)
    # Run on the exact price before the request is queued (TEI without truncation: 422 for a text over the token
    # limit, before it runs or is charged)
    check_tokens: Callable[[Quote], None] | None = None


async def classify_call(runtime: Runtime, caller: Caller, call: Call, request: Request
                        ) -> tuple[BudgetChoice, Answered]:
    """A validated, authenticated request of any route that classifies, start to finish."""
    supports_auto = runtime.info.supports_auto if runtime.info else False
    choice = choose_budget(call.inside, call.outside, caller, supports_auto, runtime.decider_pending)
    priced = None
    if call.check_tokens is not None:
        priced = await price(runtime, caller.tier, call.texts, choice)
        call.check_tokens(priced)
    return choice, await run(runtime, caller, call.texts, choice, request, priced)


async def answer(runtime: Runtime, caller: Caller, body: ClassifyRequest, params: BudgetParams,
                 request: Request) -> dict[str, Any]:
    """A validated, authenticated /classify request (the route and the fast path): the answer's body, as
    ``classify_body`` builds it."""
    started = time.perf_counter()
    call = Call(body.all_texts(), params, BudgetParams(body.budget, body.max_latency_ms, body.max_budget))
    choice, answered = await classify_call(runtime, caller, call, request)
    return classify_body(runtime, caller, choice, answered, request, started)


# Texts longer than this in all are tokenized for their price in the loop's executor (the tokenizer releases the
# GIL), so that a 64-text request of long texts never blocks the event loop; short ones are priced inline.
_INLINE_PRICE_CHARS = 8192


def _priced_inline(texts: list[str]) -> bool:
    return sum(len(t) for t in texts) <= _INLINE_PRICE_CHARS


def metered(tier: TierConfig) -> bool:
    """Whether requests of ``tier`` are priced before they run (a compute quota or a per-request cap)."""
    return tier.compute_per_minute is not None or tier.max_request_compute is not None


async def price(runtime: Runtime, tier: TierConfig, texts: list[str], choice: BudgetChoice) -> Quote:
    """The request priced at the most it may run, with the exact token counts the engine will see.

    Where the tokens come from: the engine's ``count_tokens`` may only be called from the engine's one thread,
    which may be in a forward pass of seconds, and the batcher counts there (at dispatch, for latency targets):
    too late for admission, which must refuse before a request takes a queue slot. The engine's Meter has a
    tokenizer of its own and prices plans as plain data, so admission counts here, on the loop (or its executor).
    """
    meter, unit = runtime.batcher.meter, runtime.unit
    if meter is None or unit is None:
        raise Unavailable("the model is not loaded yet", retry_after_s=5)
    budget = choice.request.priced(tier.max_budget)
    if _priced_inline(texts):
        return quote(meter, unit, texts, budget)
    return await asyncio.get_running_loop().run_in_executor(None, quote, meter, unit, texts, budget)


@dataclass(frozen=True)
class Answered:
    """A request the model answered, what it is charged, and the budget each text ran at (``text_budgets``)."""

    result: JobResult
    bill: Bill
    applied: list[float]


async def run(runtime: Runtime, caller: Caller, texts: list[str], choice: BudgetChoice, request: Request,
              priced: Quote | None = None) -> Answered:
    """The queue path of /classify and the TEI routes: admit at the request's floor price (422 over the tier's cap,
    429 over the request rate or the compute quota: a refusal tokenizes nothing), price it exactly (422 over the
    cap), queue, wait (or cancel if the client leaves), charge what ran, metrics, the feedback store and the access
    log's fields. ``priced``: the request's Quote, if the route made one."""
    meter = runtime.batcher.meter
    if runtime.info is None or runtime.unit is None or meter is None or not runtime.batcher.ready:
        raise Unavailable("the model is not loaded yet", retry_after_s=5)
    tier = caller.tier
    admitted = priced
    if priced is None and metered(tier):
        admitted = floor_quote(meter, runtime.unit, texts, choice.request.priced(tier.max_budget))
    if admitted is not None:
        check_cap(tier, admitted)
    charge = admitted.total if admitted is not None else 0  # what the quota holds until the answer settles it
    # The id every write of this request's compute counts under (not the request id: a client may repeat that).
    charge_id = new_request_id()
    request.state.charge_id = charge_id
    reserved = await admit(runtime.state, runtime.config.state, runtime.metrics, caller, charge, charge_id,
                           runtime.rate_memo)
    try:
        if admitted is not None and not admitted.exact:  # admitted: now the exact price, tokenized once
            if not _priced_inline(texts):  # a request too large to price inline is refused (503) before pricing
                runtime.batcher.precheck(texts, tier, choice.request, caller.owner, admitted)
            priced = await price(runtime, tier, texts, choice)
            check_cap(tier, priced)
        job = runtime.batcher.submit(texts, tier, choice.request, caller.owner, priced)
        try:
            result = await _wait(request, job)
        except (ClientGone, asyncio.CancelledError):
            runtime.batcher.cancel(job)
            reserved = False  # its batch may have run: the reservation stands, and nothing is billed
            raise
    except BaseException:
        if reserved:  # refused or failed by the server: not the key's compute
            await _settle(runtime, caller, -charge, charge_id)
        raise
    charged = bill(runtime.unit, result.predictions)
    if reserved and charged.total != charge:  # degraded, auto, or a type that chose fewer heads: what ran
        await _settle(runtime, caller, charged.total - charge, charge_id)
    applied = text_budgets(result)
    runtime.metrics.observe_answer(tier.name, caller.name, [p.cost for p in result.predictions], result.degraded,
                                   units(charged.total), units(charged.saved))
    await _record_usage(runtime, caller, len(texts), charged, charge_id)
    await _remember(runtime, request.state.request_id, caller, result, applied)
    _annotate(request, choice, result, len(texts), charged)
    return Answered(result, charged, applied)


async def _record_usage(runtime: Runtime, caller: Caller, n_texts: int, charged: Bill, charge_id: str) -> None:
    usage = Usage(units=charged.total, requests=1, texts=n_texts, tokens=charged.tokens, saved=charged.saved)
    row = UsageRow(utc_day(), caller.owner, caller.name, caller.tier.name, usage)
    try:
        await runtime.state.record_usage(row, charge_id)
        return
    except StateUnavailable as e:  # the answer stands; its usage waits in the journal for the store
        runtime.metrics.state_errors.labels(operation="usage").inc()
        runtime.metrics.set_state_up(False)
        reason = str(e)
    journal = runtime.journal
    if journal is not None and await asyncio.to_thread(journal.append, Entry(charge_id, row)):
        return
    log.error("usage of key %s lost (%s): charge %s, %s compute units, %d texts: %s", caller.name,
              "journal full" if journal is not None else "no journal_dir", charge_id, units(charged.total),
              n_texts, reason)


async def _settle(runtime: Runtime, caller: Caller, delta: int, charge_id: str) -> None:
    compute = ComputeLimit.of(caller.tier)
    if compute is None:  # the tier's quota went away in a reload meanwhile
        return
    try:
        await runtime.state.settle(caller.owner, compute, delta, charge_id)
    except StateUnavailable as e:  # the answer stands; the quota keeps what was reserved
        runtime.metrics.state_errors.labels(operation="settle").inc()
        runtime.metrics.set_state_up(False)
        log.warning("could not settle a request's charge: %s", e)


def classify_body(runtime: Runtime, caller: Caller, choice: BudgetChoice, answered: Answered, request: Request,
                  started: float) -> dict[str, Any]:
    """/classify's answer: ClassifyResponse's fields in its order, as plain data. The fast path writes it as it is
    (pydantic-core's JSON, as model_dump_json writes the model); the route validates it into the model: building
    the models would validate every one of the server's own numbers again."""
    info, result = runtime.info, answered.result
    assert info is not None
    requested: float | str = "auto" if choice.auto else float(result.budget_requested)
    latency_ms, degraded = round(result.latency_s * 1000, 3), result.degraded
    # a request run in parts: each text's own pass
    pass_ms = [round(s * 1000, 3) for s in result.pass_s] if result.pass_s else [latency_ms] * len(result.predictions)
    results = [{
        "label": p.label, "scores": p.scores, "budget_requested": requested, "budget_applied": float(b),
        "budget_chosen": p.budget_chosen, "passes": list(p.passes) if p.passes else None,
        "heads_active": p.cost.heads_active, "heads_total": p.cost.heads_total,
        "neurons_active": p.cost.neurons_active, "neurons_total": p.cost.neurons_total,
        "cost": round(p.cost.ratio, 6), "attention_cost": round(p.cost.attention_ratio, 6),
        "truncated": p.truncated, "n_tokens": p.n_tokens, "latency_ms": ms, "degraded": degraded,
        "charge": units(c)}
        for p, b, c, ms in zip(result.predictions, answered.applied, answered.bill.texts, pass_ms, strict=True)]
    return {
        "model": {"name": info.name, "checksum": info.checksum}, "request_id": request.state.request_id,
        "tier": caller.tier.name, "budget_source": choice.source, "max_latency_ms": choice.max_latency_ms,
        "degraded": degraded, "queue_ms": round(result.queue_s * 1000, 3),
        "latency_ms": round((time.perf_counter() - started) * 1000, 3), "charge": units(answered.bill.total),
        "results": results}


def text_budgets(result: JobResult) -> list[float]:
    """Each text's applied budget: the budget its request ran under, which bounds the text's cost. Under auto, the
    ceiling its passes (or its own choice) stayed within; what it chose is the text's budget_chosen."""
    return [result.budget_applied] * len(result.predictions)


async def _remember(runtime: Runtime, request_id: str, caller: Caller, result: JobResult,
                    applied: list[float]) -> None:
    record = AnswerRecord(owner=caller.owner, tier=caller.tier.name,
                          labels=[p.label for p in result.predictions], budgets=applied,
                          bucket=runtime.metrics.budget_label(result.budget_applied, result.auto))
    try:
        await runtime.state.remember(request_id, record)
    except StateUnavailable as e:  # the answer stands; only feedback on it will not be found
        runtime.metrics.state_errors.labels(operation="remember").inc()
        runtime.metrics.set_state_up(False)
        log.warning("could not store the answer for feedback: %s", e)


def _annotate(request: Request, choice: BudgetChoice, result: JobResult, n_texts: int, charged: Bill) -> None:
    """Fields for the access log."""
    s = request.state
    s.charge = units(charged.total)
    s.budget_requested = AUTO if choice.auto else result.budget_requested
    s.budget_applied = result.budget_applied  # the batch's budget (for auto and caps: the cap, or the ceiling)
    s.budget_source, s.degraded, s.n_texts = choice.source, result.degraded, n_texts
    s.queue_ms = round(result.queue_s * 1000, 3)
