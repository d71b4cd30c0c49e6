"""Request and response bodies of the HTTP API (pydantic v2); they define the OpenAPI schema."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

# The smallest budget served, by the API and the CLI alike (budget_arg): below it a plan keeps too little to be a
# model. Here, not in the engine, because the client installs this module without numpy.
MIN_BUDGET = 0.1
MAX_TEXTS = 64  # texts per request
MAX_TEXT_CHARS = 100_000  # longer texts are refused; texts over the token limit are truncated instead
MAX_LATENCY_MS = 60_000.0


def _not_bool(value: object) -> object:
    # pydantic reads true as 1 where a number is due: "budget": true would run (and be charged) at budget 1
    if isinstance(value, bool):
        raise ValueError("a number, not true or false")
    return value


Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]
BudgetValue = Annotated[float, Field(ge=MIN_BUDGET, le=1.0, allow_inf_nan=False), BeforeValidator(_not_bool)]
BudgetParam = BudgetValue | Literal["auto"]
LatencyLimit = Annotated[float, Field(gt=0, le=MAX_LATENCY_MS, allow_inf_nan=False), BeforeValidator(_not_bool)]
BudgetSource = Literal["request", "tier_default", "max_latency_ms"]  # where the budget came from, not what it is


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _blank(text: str) -> bool:
    return not text or text.isspace()  # `not text.strip()` without copying the text


class ClassifyRequest(_Body):
    """Texts to classify, with an optional budget or latency limit (a query parameter may give them too)."""

    text: Text | None = Field(None, description="One text; give `text` or `texts`, not both.")
    texts: Annotated[list[Text], Field(min_length=1, max_length=MAX_TEXTS)] | None = Field(
        None, description=f"Up to {MAX_TEXTS} texts, answered in order.")
    budget: BudgetParam | None = Field(
        None, description="Fraction of the dense model's multiply-adds to spend, in [0.1, 1]: the heads, "
                          "feed-forward neurons and layers it buys (heads only on an attention-scope checkpoint); "
                          "on checkpoints that predict their own budget per text (`supports_auto` in /v1/models) a "
                          "number is a cap and `auto` runs each text at its own, capped at the tier's max_budget; "
                          "on a budgeted checkpoint with a "
                          "decider (`decider` in /v1/models) `auto` lets the decider pick each text's budget at "
                          "the checkpoint's default operating point. Default: the tier's default.")
    max_budget: BudgetValue | None = Field(
        None, description="With `budget=auto`: a ceiling, in [0.1, 1] and at most the tier's max_budget (403 "
                          "above): no text spends more than one pass at this budget (all its passes together). "
                          "Default: the tier's max_budget.")
    max_latency_ms: LatencyLimit | None = Field(
        None, description="Instead of a budget: the highest budget whose latency for these texts fits (the lowest "
                          "when none does).")

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        if v is not None and _blank(v):
            raise ValueError("text is empty or whitespace")
        return v

    @field_validator("texts")
    @classmethod
    def _none_blank(cls, v: list[str] | None) -> list[str] | None:
        for i, t in enumerate(v or ()):
            if _blank(t):
                raise ValueError(f"texts[{i}] is empty or whitespace")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> ClassifyRequest:
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of `text` or `texts`")
        if self.budget is not None and self.max_latency_ms is not None:
            raise ValueError("give `budget` or `max_latency_ms`, not both")
        return self

    def all_texts(self) -> list[str]:
        """The texts as a list, whichever field carried them."""
        return [self.text] if self.text is not None else list(self.texts or ())


class ModelRef(BaseModel):
    """Which checkpoint answered."""

    name: str
    checksum: str = Field(description="SHA-256 of the checkpoint weights")


class TextResult(BaseModel):
    """One text's answer."""

    label: str
    scores: dict[str, float] = Field(description="label -> probability")
    budget_requested: float | Literal["auto"] = Field(
        description="the budget asked for (the request's, the tier default, or the one `max_latency_ms` chose), "
                    "or `auto`: the checkpoint chose this text's budget")
    budget_applied: float = Field(
        description="the budget this text ran under, which bounds its `cost`: the requested one, lower if "
                    "degraded; for `auto`, the ceiling (the tier's max_budget or max_budget, lower if degraded): "
                    "on checkpoints that predict their own budget the cap of that choice, through a decider the "
                    "budget all of the text's passes together stay within")
    budget_chosen: float | None = Field(
        None, description="what `auto` chose for this text: on checkpoints that predict their own budget, the "
                          "fraction of heads it chose to run, within the heads `budget_applied` buys as a cap; "
                          "through a decider, the budget of the pass that gave the answer (the last of `passes`); "
                          "null otherwise")
    passes: list[float] | None = Field(
        None, description="`auto` through a decider: the budget of every pass this text ran, in order (a cascade "
                          "runs a cheap pass first and escalates unsure texts); `cost` counts them all. Null when "
                          "no decider ran (one pass at budget_applied)")
    heads_active: int = Field(description="heads computed, summed over layers (of the last pass, under `auto` "
                                          "through a decider)")
    heads_total: int
    # The three fields below default to None only so that this client still reads older servers' answers.
    neurons_active: int | None = Field(None, description="feed-forward neurons computed, summed over layers (all "
                                       "of them unless the checkpoint's budget spans the whole model)")
    neurons_total: int | None = None
    cost: float = Field(description="fraction of the dense model's multiply-adds spent on this text (the whole "
                                    "forward pass, at the text's own length)")
    attention_cost: float | None = Field(None, description="fraction of the dense attention blocks' multiply-adds "
                                         "spent")
    truncated: bool = Field(description="the text was longer than the token limit and was cut")
    n_tokens: int
    latency_ms: float = Field(description="forward pass of the batch this text ran in")
    degraded: bool = Field(description="run below the requested budget (for `auto`: under a cap below the tier's "
                                       "max_budget) to meet the tier's latency target")
    charge: float | None = Field(None, description="compute units charged for this text: the multiply-adds it ran "
                                 "(`cost` of the dense pass at its length) in units of `compute_unit` (/v1/models)")


class ClassifyResponse(BaseModel):
    """Answers in the order of the texts, and how the budget was chosen."""

    model: ModelRef
    request_id: str
    tier: str
    budget_source: BudgetSource = Field(
        description="where the budget came from: the request's `budget` (a number or `auto`), the tier's default "
                    "(a number or `auto`), or `max_latency_ms`")
    max_latency_ms: float | None = None
    degraded: bool
    queue_ms: float = Field(description="time spent waiting for the model")
    latency_ms: float = Field(description="time from arrival to answer inside the server")
    charge: float | None = Field(None, description="compute units charged for the request: the sum of its texts' "
                                 "charges, what counts against the key's compute quota and usage")
    results: list[TextResult]


class FeedbackRequest(_Body):
    """The true label of an earlier answer."""

    request_id: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    label: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    index: Annotated[int, Field(ge=0, lt=MAX_TEXTS), BeforeValidator(_not_bool)] = Field(
        0, description="which text of the request")


class FeedbackResponse(BaseModel):
    """Whether the earlier answer was right, and the budget it ran at."""

    request_id: str
    index: int
    correct: bool
    budget_applied: float


class BudgetPoint(BaseModel):
    """One point of the checkpoint's budget grid."""

    budget: float
    heads_active: int = Field(description="heads the budget buys (for a checkpoint that picks its own heads "
                                          "per text: the most one text may run)")
    neurons_active: int | None = Field(None, description="feed-forward neurons the budget buys, summed over "
                                                         "layers; null when every neuron always runs")
    layers_run: int | None = Field(None, description="layers the budget runs before it answers, when it stops at "
                                                     "one of the checkpoint's exits; null when it runs every layer")
    accuracy: float | None = Field(None, description="offline accuracy from sweep.json")
    latency_ms: float | None = Field(None, description="one pass of one text of `latency_tokens` tokens: the "
                                     "benchmark table (or, without bench.json, the engine's own timing at "
                                     "start-up), corrected by the passes the service has run; never below a "
                                     "smaller budget's")
    latency_tokens: int | None = Field(None, description="the text length `latency_ms` is for (a shorter text "
                                       "takes less)")


class ComputeUnitInfo(BaseModel):
    """What one compute unit is: what answers, quotas and usage count in."""

    description: str
    reference_tokens: int = Field(description="the length the unit is defined at")
    reference_macs: int = Field(description="multiply-adds of the dense model on one text of reference_tokens "
                                            "tokens: reference_tokens units")
    macs: float = Field(description="multiply-adds in one unit")


class ModelCard(BaseModel):
    """The loaded checkpoint."""

    id: str
    object: Literal["model"] = "model"
    checksum: str
    labels: list[str]
    n_layers: int
    n_heads: int
    heads_total: int
    max_length: int
    supports_auto: bool
    decider: str | None = Field(None, description="what serves `budget=auto` on a budgeted checkpoint: its "
                                "decider's kind (cascade or predictor); null where the checkpoint predicts its own "
                                "budget or has no auto")
    dense_accuracy: float | None
    budgets: list[BudgetPoint]
    compute_unit: ComputeUnitInfo | None = Field(None, description="what one compute unit (`charge`) is")


class ModelList(BaseModel):
    """The models this server runs (one)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """Liveness."""

    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """Readiness and what it depends on."""

    status: Literal["ready", "not_ready"]
    checks: dict[str, str]


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every 4xx and 5xx answer."""

    error: ErrorDetail


class UsageAmounts(BaseModel):
    """What a key spent over a period."""

    units: float = Field(description="compute units charged (see compute_unit in /v1/models)")
    requests: int = Field(description="requests answered")
    texts: int
    tokens: int
    saved_units: float = Field(description="compute units the answers did not spend against the dense model")


class QuotaNow(BaseModel):
    """The calling key's limits and what it may send at once now."""

    requests_per_minute: float
    request_burst: int
    requests_left: int = Field(description="requests the key may send at once now")
    compute_per_minute: float | None = Field(description="compute units per minute; null: no compute quota")
    compute_burst: float | None
    compute_left: float | None = Field(description="compute units the key may spend at once now (refilling at "
                                                   "compute_per_minute); null: no compute quota")
    max_request_compute: float | None = Field(description="the most one request may be charged; null: no cap "
                                                          "but the burst")


class UsageReport(BaseModel):
    """The calling key's quota now and its usage today (UTC) and in all; nothing about any other key."""

    key: str = Field(description="the key's name")
    tier: str
    date: str = Field(description="today, UTC (YYYY-MM-DD): the day `today` counts")
    quota: QuotaNow
    today: UsageAmounts
    total: UsageAmounts
