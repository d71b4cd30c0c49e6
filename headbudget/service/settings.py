"""Service configuration: the TOML file (tiers, keys, batching, state) and the start-up settings, parsed once.

The environment overrides both (pydantic-settings): ``HEADBUDGET_<TABLE>__<KEY>`` sets one value of the TOML file
(``HEADBUDGET_SERVER__MAX_BATCH_SIZE=8``, ``HEADBUDGET_STATE__REDIS_URL=redis://...``,
``HEADBUDGET_TIERS__CHEAP__MAX_BUDGET=0.5``; ``HEADBUDGET_SERVER='{"max_batch_size": 8}'`` a table as JSON), and
``HEADBUDGET_MODEL_DIR``, ``HEADBUDGET_PRECISION``, ... the options of ``headbudget serve`` (a flag wins). A bad
value refuses to start with one line naming the variable.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from headbudget.engine.types import Backend, EngineOptions, Precision
from headbudget.service.http.schemas import MIN_BUDGET

Budget = Annotated[float, Field(ge=MIN_BUDGET, le=1.0, allow_inf_nan=False)]
AUTO: Final = "auto"  # each text at its own budget (BudgetFormer's, or a decider's: decider.json); a metrics label
SERVE_ENV = "HEADBUDGET_SERVE"  # how `headbudget serve` hands ServeSettings to uvicorn workers (JSON)
# Settings from the environment. SERVE_ENV shares the prefix but names no field of ConfigEnv or ServeEnv below
# ("serve" is neither a table nor a serve option), so it is never read as a setting.
ENV_PREFIX: Final = "HEADBUDGET_"


class ConfigError(ValueError):
    """The service configuration is invalid; the service refuses to start (or keeps the old one on reload)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The most compute units a quota, burst or cap may name: the quota's integer arithmetic in milli-units (Redis's
# Lua numbers are doubles) stays exact below 2**53 with a burst of up to 1e8 units.
MAX_COMPUTE_UNITS: Final = 1e8


def _units(value: object) -> object:
    """A number of compute units as given; true/false, NaN and infinities are refused as such (not as "below the
    minimum", which is how the bounds alone would name a NaN)."""
    if isinstance(value, bool):
        raise ValueError("expected a number of compute units, not true/false")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number of compute units, not {value}")
    return value


ComputeUnits = Annotated[float, BeforeValidator(_units),
                         Field(ge=0.001, le=MAX_COMPUTE_UNITS, allow_inf_nan=False)]


class TierConfig(_Strict):
    """One pricing tier: which budgets its keys may buy, how fast, and how it is scheduled."""

    name: str = ""  # filled from the table name
    # used when a request names no budget; "auto": each text's own budget, within max_budget (only on checkpoints
    # that predict one or have a decider: the server refuses to start, or to reload, otherwise)
    default_budget: Budget | Literal["auto"] = 0.5
    max_budget: Budget = 1.0  # a higher explicit budget is refused with 403
    rate_limit: Annotated[float, Field(gt=0)] = 600.0  # requests per minute per key
    burst: Annotated[int, Field(ge=1)] = 20  # requests a key may send at once before the rate applies
    priority: int = 0  # higher is served first under contention
    max_queue: Annotated[int, Field(ge=1)] = 128  # requests of this tier waiting at once; beyond: 503
    latency_target_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None  # degrade to meet it
    min_budget: Budget | None = None  # lowest budget degradation may go to (default 0.1)
    # Compute, in compute units (service/accounting/compute.py) per key; absent: no limit but the request rate.
    compute_per_minute: ComputeUnits | None = None  # units a key may spend per minute
    compute_burst: ComputeUnits | None = None  # units a key may spend at once (default: compute_per_minute)
    max_request_compute: ComputeUnits | None = None  # one request's charge at most; over it: 422 before any work

    @model_validator(mode="after")
    def _check(self) -> TierConfig:
        if not isinstance(self.default_budget, str) and self.default_budget > self.max_budget:
            raise ValueError(f"default_budget {self.default_budget} is above max_budget {self.max_budget}")
        if self.compute_burst is not None and self.compute_per_minute is None:
            raise ValueError("compute_burst is set but compute_per_minute is not (the burst refills at that rate)")
        burst = self.burst_units
        if burst is not None and self.max_request_compute is not None and self.max_request_compute > burst:
            raise ValueError(f"max_request_compute {self.max_request_compute:g} is above compute_burst {burst:g}: "
                             "a request that large could never be admitted")
        if self.min_budget is not None and self.min_budget > self.default_cap:
            which = "max_budget" if self.default_budget == AUTO else "default_budget"
            raise ValueError(f"min_budget {self.min_budget} is above {which} {self.default_cap}")
        return self

    @property
    def default_cap(self) -> float:
        """The default budget as a number: "auto" runs capped at the tier's max_budget."""
        return self.max_budget if isinstance(self.default_budget, str) else self.default_budget

    @property
    def degrades(self) -> bool:
        """Whether this tier trades budget for latency under load."""
        return self.latency_target_ms is not None

    @property
    def floor_budget(self) -> float:
        """The lowest budget degradation may choose."""
        return self.min_budget if self.min_budget is not None else 0.1

    @property
    def burst_units(self) -> float | None:
        """Compute units a key may spend at once (None: no compute quota)."""
        return self.compute_burst if self.compute_burst is not None else self.compute_per_minute


def utc_instant(value: object) -> datetime:
    """A key's time as an aware UTC datetime: a TOML date (00:00 UTC that day), a TOML datetime or an ISO
    string (without an offset: UTC). Anything else (a number, a bare time) is refused rather than guessed."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value) if "T" in value or " " in value else date.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a date (2026-12-31) or an ISO datetime "
                             "(2026-12-31T18:00:00Z)") from None
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC)
    raise ValueError("expected a date (2026-12-31) or an ISO datetime (2026-12-31T18:00:00Z)")


def utc_text(t: datetime | None) -> str:
    """An instant as the file spells it (2026-12-31T00:00:00Z); "-" for none."""
    return "-" if t is None else t.astimezone(UTC).isoformat().replace("+00:00", "Z")


UtcInstant = Annotated[datetime, BeforeValidator(utc_instant)]
KeyState = Literal["active", "revoked", "expired"]


class KeyConfig(_Strict):
    """One API key, stored as the SHA-256 of the key (never the key itself)."""

    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    tier: str
    name: str = ""  # a label for logs and audits; never the key
    # A revoked key keeps its entry, so that audits can still tell whose it was and since when it is refused.
    revoked: StrictBool = False
    revoked_at: UtcInstant | None = None
    expires: UtcInstant | None = None  # refused from this instant on, reload or not

    @model_validator(mode="after")
    def _check(self) -> KeyConfig:
        if self.revoked_at is not None and not self.revoked:
            raise ValueError("revoked_at is set but revoked is not true")
        return self

    def state(self, now: float) -> KeyState:
        """Whether the key is served at ``now`` (Unix seconds): a revocation outranks an expiry."""
        if self.revoked:
            return "revoked"
        if self.expires is not None and now >= self.expires.timestamp():
            return "expired"
        return "active"


class ServerConfig(_Strict):
    """Batching, queue and input limits."""

    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 32  # texts per forward pass
    max_wait_ms: Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False)] = 3.0  # batch window
    queue_size: Annotated[int, Field(ge=1)] = 256  # requests waiting, all tiers together
    request_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 30.0  # longest wait in queue
    max_body_bytes: Annotated[int, Field(ge=1024)] = 1 << 20
    graceful_timeout_s: Annotated[float, Field(gt=0)] = 30.0  # how long shutdown waits for in-flight work
    # Serve well-formed POST /classify requests without FastAPI's per-request layers (service/http/fastpath.py);
    # false sends every request through FastAPI (the reference the fast path is tested against).
    fast_path: bool = True
    # The most activation memory one forward pass may take, in MiB, as the engine estimates it (engine/passes.py):
    # a batch above it runs in several passes, so whatever a worker is sent its memory peaks within about 1.5x
    # this above idle (docs/results.md, 'Memory under large requests'; deploy/kubernetes sizes pods by it). Read
    # at start-up; a reload keeps the running value.
    max_activation_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 128
    # The most engine work one batch runs, as the latency model estimates it, before the queue is looked at again:
    # a request over it runs as several passes, and between them the fair queue serves other keys (a key waits
    # at most about one pass of another's). A single text over it runs alone.
    max_pass_ms: Annotated[float, Field(gt=0, le=60_000, allow_inf_nan=False)] = 50.0


class StateConfig(_Strict):
    """Where rate limits and the feedback store live."""

    redis_url: str = ""  # empty: in this process's memory (one worker only)
    on_error: Literal["open", "closed"] = "open"  # rate limits when Redis is unreachable
    redis_timeout_s: Annotated[float, Field(gt=0)] = 0.25
    feedback_ttl_s: Annotated[float, Field(gt=0)] = 86_400.0  # how long answers can receive feedback
    feedback_max_entries: Annotated[int, Field(ge=1)] = 100_000  # per worker in memory
    accuracy_window: Annotated[int, Field(ge=1)] = 1000  # feedbacks per budget in the online accuracy
    # Where answered usage waits while Redis does not take it (service/accounting/journal.py); "" keeps none, and such usage
    # is logged as lost. Shared by the workers of a replica: on a volume that outlives the process.
    journal_dir: str = ""
    journal_max_bytes: Annotated[int, Field(ge=4096)] = 64 * 1024 * 1024  # per process file


class MetricsConfig(_Strict):
    """What /metrics labels by (changes need a restart)."""

    # Label the compute counters by key name too: one series per key and tier, so only with few keys.
    per_key: bool = False


class DevelopmentConfig(_Strict):
    """Conveniences that must stay off in production."""

    anonymous_tier: str | None = None  # requests without a key get this tier; absent = 401
    curl_tier: str | None = None  # tier of the ephemeral key `serve --print-curl` creates


class ServiceConfig(_Strict):
    """The whole service.toml."""

    server: ServerConfig = ServerConfig()
    state: StateConfig = StateConfig()
    metrics: MetricsConfig = MetricsConfig()
    development: DevelopmentConfig = DevelopmentConfig()
    tiers: dict[str, TierConfig]
    keys: list[KeyConfig] = []
    # The keys by their hash, made once: a request finds its key in one lookup, whatever the number of keys. The
    # hash is of what the client sent, so the lookup's timing says nothing about a key it does not know.
    _by_hash: dict[str, KeyConfig] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        if not self.tiers:
            raise ValueError("at least one [tiers.NAME] table is required")
        for name in self.tiers:
            if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", name):
                raise ValueError(f"tier name {name!r}: use 1-32 letters, digits, '_' or '-'")
        known = set(self.tiers)
        hashes = [key.sha256 for key in self.keys]
        if len(set(hashes)) != len(hashes):  # one entry revoked and a copy not would leave the key in service
            twice = sorted({h[:12] for h in hashes if hashes.count(h) > 1})
            raise ValueError(f"a key is listed more than once (sha256 {', '.join(twice)}...); keep one entry")
        for key in self.keys:
            if key.tier not in known:
                raise ValueError(f"a key names tier {key.tier!r}, which is not defined ({sorted(known)})")
        for label, tier in (("anonymous_tier", self.development.anonymous_tier),
                            ("curl_tier", self.development.curl_tier)):
            if tier is not None and tier not in known:
                raise ValueError(f"development.{label} = {tier!r} is not a defined tier")
        self._by_hash = {key.sha256: key for key in self.keys}
        return self

    def key(self, sha256: str) -> KeyConfig | None:
        """The configured key with this hash, if any."""
        return self._by_hash.get(sha256)

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``."""
        return self.tiers[name]

    def auto_tiers(self) -> list[str]:
        """The tiers whose default budget is "auto"."""
        return sorted(name for name, t in self.tiers.items() if t.default_budget == AUTO)

    def check_model(self, model: str, supports_auto: bool) -> None:
        """Refuse (ConfigError) a config that the loaded checkpoint cannot serve: "auto" tier defaults."""
        tiers = self.auto_tiers()
        if tiers and not supports_auto:
            named = ("tier " if len(tiers) == 1 else "tiers ") + ", ".join(repr(t) for t in tiers)
            raise ConfigError(f"{named}: default_budget = \"auto\", but checkpoint {model!r} does not predict its "
                              f"own budget and has no decider (supports_auto is false); give a numeric "
                              f"default_budget, or make a decider with `headbudget decider`")

    def default_budgets(self) -> tuple[float, ...]:
        """Every tier's default budget as a number (what most requests run at: the engine prepacks these)."""
        return tuple(sorted({t.default_cap for t in self.tiers.values()}))

    def latency_targets_s(self) -> list[float]:
        """Every tier's latency target in seconds (histogram bucket boundaries)."""
        return sorted({t.latency_target_ms / 1000.0 for t in self.tiers.values() if t.latency_target_ms})


def parse_config(data: dict[str, Any], env_names: Mapping[tuple[str, ...], str] | None = None) -> ServiceConfig:
    """Validate a parsed TOML document; tier names are copied into each tier. ``env_names``: the environment
    variable behind a value (from ``env_overrides``), named in its error instead of its place in the file."""
    tiers = data.get("tiers")
    if isinstance(tiers, dict):
        data = {**data, "tiers": {n: {**t, "name": n} if isinstance(t, dict) else t for n, t in tiers.items()}}
    try:
        return ServiceConfig.model_validate(data)
    except ValidationError as e:
        places = [_error_place(tuple(str(p) for p in err["loc"]), env_names or {}) for err in e.errors()]
        lines = [f"{place}: {err['msg']}" if place else err["msg"] for place, err in zip(places, e.errors(), strict=True)]
        raise ConfigError("; ".join(lines)) from None


def _error_place(loc: tuple[str, ...], env_names: Mapping[tuple[str, ...], str]) -> str:
    """The environment variable that set ``loc`` (or a table above it), else the dotted place in the file and
    the variables that changed something under it (a tier's cross-field check)."""
    for n in range(len(loc), 0, -1):
        if loc[:n] in env_names:
            return env_names[loc[:n]]
    below = sorted(name for path, name in env_names.items() if path[:len(loc)] == loc)
    with_env = f"with {', '.join(below)} from the environment" if below else ""
    return f"{'.'.join(loc)} ({with_env})" if loc and with_env else ".".join(loc) or with_env


class ConfigEnv(BaseSettings):
    """Overrides of service.toml's tables from the environment (HEADBUDGET_<TABLE>__<KEY>, or a table as JSON);
    the values are validated with the file's, by ServiceConfig."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False,
                                      extra="ignore", frozen=True)

    server: dict[str, Any] = {}
    state: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    development: dict[str, Any] = {}
    tiers: dict[str, dict[str, Any]] = {}


def _env_name(path: tuple[str, ...]) -> str:
    """The variable that set ``path``: HEADBUDGET_A__B if it is set, else the JSON table HEADBUDGET_A."""
    upper = {k.upper() for k in os.environ}
    for n in range(len(path), 0, -1):
        name = ENV_PREFIX + "__".join(path[:n]).upper()
        if name in upper:
            return name
    return ENV_PREFIX + "__".join(path).upper()


def env_overrides(data: dict[str, Any]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """``data`` (a parsed service.toml) with the environment's values on top, and the variable behind each
    overridden value. Tiers: only those the file defines (names matched case-insensitively)."""
    try:
        env = ConfigEnv()
    except SettingsError as e:
        field = str(e).split('"')[1] if str(e).count('"') >= 2 else ""
        raise ConfigError(f"{ENV_PREFIX}{field.upper()}: not valid JSON") from None
    data, names = dict(data), dict[tuple[str, ...], str]()
    for table in ("server", "state", "metrics", "development"):
        values: dict[str, Any] = getattr(env, table)
        if values:
            base = data.get(table, {})
            data[table] = {**base, **values} if isinstance(base, dict) else values
            names.update({(table, key): _env_name((table, key)) for key in values})
    if env.tiers:
        tiers = dict(data["tiers"]) if isinstance(data.get("tiers"), dict) else {}
        by_lower = {name.lower(): name for name in tiers}
        for env_tier, values in env.tiers.items():
            name = by_lower.get(env_tier.lower())
            if name is None:
                raise ConfigError(f"{_env_name(('tiers', env_tier))}: no tier {env_tier!r} in the config file "
                                  f"({sorted(tiers)}); the environment can only change a defined tier")
            base = tiers[name]
            tiers[name] = {**base, **values} if isinstance(base, dict) else values
            names.update({("tiers", name, key): _env_name(("tiers", env_tier, key)) for key in values})
        data["tiers"] = tiers
    return data, names


def load_config(path: Path) -> ServiceConfig:
    """Read and validate a service TOML file with the environment's overrides (``env_overrides``) on top;
    raises ConfigError with a one-line reason."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse_config(*env_overrides(data))


class ServeSettings(BaseModel):
    """What one server process needs at start-up (CLI flags), passed to workers as JSON in the environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path
    config_path: Path
    backend: Backend = "onnxruntime"
    precision: Precision = "int8"  # `headbudget serve` picks fp32 where int8 has no engine
    threads: Annotated[int, Field(ge=1)] = 1
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # every process's, workers' included
    access_log: Path | None = None  # access records to this file instead of stderr
    extra_key_hashes: dict[str, str] = {}  # sha256 -> tier: ephemeral keys (serve --print-curl), never written
    decider_pending: bool = False  # a decider is being made beside the server (serve --decider-data)

    def engine_options(self, prepacked_budgets: tuple[float, ...] | None = None,
                       max_activation_mb: int | None = None) -> EngineOptions:
        """The engine options these settings select; ``prepacked_budgets`` (the tiers' defaults) and
        ``max_activation_mb`` ([server]) if given."""
        options = EngineOptions(backend=self.backend, precision=self.precision, threads=self.threads,
                                max_activation_bytes=None if max_activation_mb is None else max_activation_mb << 20)
        return options if prepacked_budgets is None else replace(options, prepacked_budgets=prepacked_budgets)

    def to_env(self) -> str:
        """Serialize for the HEADBUDGET_SERVE environment variable."""
        return self.model_dump_json()

    @classmethod
    def from_env(cls) -> ServeSettings:
        """Read the settings `headbudget serve` put in the environment."""
        raw = os.environ.get(SERVE_ENV)
        if not raw:
            raise ConfigError(f"{SERVE_ENV} is not set; start the service with `headbudget serve`")
        return cls.model_validate(json.loads(raw))


class ServeEnv(BaseSettings):
    """Options of `headbudget serve` from the environment (HEADBUDGET_MODEL_DIR, HEADBUDGET_PRECISION, ...);
    a flag given on the command line wins over its variable. Unset: the command's defaults."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, case_sensitive=False, extra="ignore", frozen=True)

    model_dir: Path | None = None
    config: Path | None = None
    backend: Backend | None = None
    precision: Precision | None = None
    threads: Annotated[int, Field(ge=1)] | None = None
    host: str | None = None
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    workers: Annotated[int, Field(ge=1)] | None = None
    log_level: Literal["debug", "info", "warning", "error"] | None = None


def serve_env() -> ServeEnv:
    """`headbudget serve` options from the environment; a bad value is a ConfigError naming its variable."""
    try:
        return ServeEnv()
    except ValidationError as e:
        lines = [f"{ENV_PREFIX}{str(err['loc'][0]).upper()}: {err['msg']}" for err in e.errors()]
        raise ConfigError("; ".join(lines)) from None
