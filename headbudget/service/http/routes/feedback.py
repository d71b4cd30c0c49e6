"""POST /feedback."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from headbudget.service.errors import Conflict, InvalidRequest, NotFound, Unavailable
from headbudget.service.http.deps import CallerDep, RuntimeDep
from headbudget.service.http.routes import error_responses
from headbudget.service.http.schemas import FeedbackRequest, FeedbackResponse
from headbudget.service.state.store import AlreadyReported, AnswerNotFound, StateUnavailable

router = APIRouter(tags=["feedback"])
log = logging.getLogger("headbudget.service")


@router.post("/feedback", response_model=FeedbackResponse,
             responses=error_responses(400, 401, 404, 409, 413, 415, 422, 429, 503))
async def give_feedback(body: FeedbackRequest, runtime: RuntimeDep, caller: CallerDep) -> FeedbackResponse:
    """Report the true label of an earlier answer; it feeds the online accuracy per budget."""
    labels = runtime.info.labels if runtime.info else ()
    if body.label not in labels:
        raise InvalidRequest(f"label {body.label!r} is not one of the model's labels {list(labels)}")
    try:
        record = await runtime.state.claim(body.request_id, caller.owner, body.index)
        correct = record.labels[body.index] == body.label
        bucket = record.budget_label(body.index)
        accuracy: float | None = await runtime.state.record_outcome(bucket, correct)
    except AnswerNotFound:
        raise NotFound(f"no answer {body.request_id!r} text {body.index} for this key (unknown or expired)"
                       ) from None
    except AlreadyReported:
        raise Conflict(f"feedback for {body.request_id!r} text {body.index} was already recorded") from None
    except StateUnavailable:
        runtime.metrics.state_errors.labels(operation="feedback").inc()
        runtime.metrics.set_state_up(False)
        raise Unavailable("the feedback store is unavailable", retry_after_s=5) from None
    runtime.metrics.observe_feedback(bucket, correct, accuracy)
    return FeedbackResponse(request_id=body.request_id, index=body.index, correct=correct,
                            budget_applied=record.budgets[body.index])
