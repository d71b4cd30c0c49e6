"""The load test's request mix: which tier calls, what it sends, and a share of requests that must be refused.

Standard library only, so that the locust container can load it beside locustfile.py without the headbudget
package. Every request is planned here as plain data (``Planned``) and sent by locustfile.py, which keeps the
mix testable without locust: tests/loadtest/ checks that good plans are valid API requests and bad ones not.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

TIERS = ("cheap", "balanced", "quality")
KEY_ENV = {tier: f"HEADBUDGET_KEY_{tier.upper()}" for tier in TIERS}
LABELS_ENV = "HEADBUDGET_LOAD_LABELS"  # comma-separated model labels (the runner reads them from /v1/models)

# Budgets each tier asks for explicitly; within the tiers' max_budget of docker/ and deploy/ configurations.
DEFAULT_BUDGETS: dict[str, tuple[float, ...]] = {
    "cheap": (0.1, 0.2, 0.3, 0.5),
    "balanced": (0.25, 0.5, 0.6, 0.8),
    "quality": (0.5, 0.75, 1.0),
}
DEFAULT_TIER_WEIGHTS = {"cheap": 0.5, "balanced": 0.35, "quality": 0.15}

Expect = Literal["ok", "client_error"]

_TOPICS: dict[str, tuple[str, ...]] = {
    "world": ("minister", "election", "ceasefire", "parliament", "embassy", "refugees", "summit", "treaty",
              "protest", "capital", "troops", "diplomats", "border", "vote", "president", "talks"),
    "sports": ("coach", "striker", "league", "final", "season", "injury", "goal", "tournament", "champion",
               "match", "team", "quarterback", "innings", "playoffs", "record", "stadium"),
    "business": ("shares", "profit", "merger", "investors", "quarter", "earnings", "market", "bank",
                 "stocks", "oil", "prices", "retailer", "deal", "revenue", "economy", "dollar"),
    "sci/tech": ("software", "chip", "internet", "researchers", "space", "launch", "patent", "browser",
                 "satellite", "genome", "wireless", "computer", "update", "scientists", "network", "linux"),
}
_FILLER = ("the", "a", "on", "after", "said", "new", "in", "with", "as", "for", "over", "its", "and", "by",
           "on Tuesday", "officials", "reported", "according to", "late", "early", "amid")


@dataclass(frozen=True)
class Planned:
    """One HTTP request of the mix, as plain data."""

    name: str  # the locust statistics entry: "<tier> <kind>" or "bad <kind>"
    method: str
    path: str
    expect: Expect  # "ok": must get 2xx; "client_error": must get 4xx (a 2xx or 5xx is a failure)
    headers: dict[str, str] = field(default_factory=dict)
    json_body: Any = None
    raw_body: bytes | None = None  # sent as-is instead of json_body (malformed JSON)
    true_labels: tuple[str, ...] = ()  # per text, for POST /feedback after a good answer


@dataclass(frozen=True)
class MixConfig:
    """Shares and choices of the mix; ``from_env`` reads keys and overrides from the environment."""

    keys: Mapping[str, str]  # tier -> API key; tiers without a key get no users
    labels: tuple[str, ...] = ()  # the model's labels (for feedback); empty: no feedback is sent
    tier_weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    budgets: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: dict(DEFAULT_BUDGETS))
    bad_share: float = 0.05  # requests that must be refused with a 4xx
    feedback_share: float = 0.2  # good answers followed by POST /feedback with the true label
    batch_share: float = 0.2  # requests carrying several texts
    latency_share: float = 0.15  # requests giving max_latency_ms instead of a budget
    default_share: float = 0.2  # requests naming no budget (the tier's default)
    max_batch: int = 16
    latency_limits_ms: tuple[float, ...] = (20.0, 50.0, 100.0, 250.0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MixConfig:
        """Keys from HEADBUDGET_KEY_<TIER>, labels from HEADBUDGET_LOAD_LABELS, shares from HEADBUDGET_LOAD_*."""
        env = os.environ if env is None else env
        keys = {t: env[k] for t, k in KEY_ENV.items() if env.get(k)}
        labels = tuple(x for x in env.get(LABELS_ENV, "").split(",") if x)
        budgets = dict(DEFAULT_BUDGETS)
        for tier in TIERS:
            raw = env.get(f"HEADBUDGET_LOAD_BUDGETS_{tier.upper()}")
            if raw:
                budgets[tier] = tuple(float(x) for x in raw.split(","))
        shares = {name: float(env[f"HEADBUDGET_LOAD_{name.upper()}"]) for name in
                  ("bad_share", "feedback_share", "batch_share", "latency_share", "default_share")
                  if env.get(f"HEADBUDGET_LOAD_{name.upper()}")}
        return cls(keys=keys, labels=labels, budgets=budgets, **shares)

    def pick_tier(self, rng: random.Random) -> str:
        """A tier with a key, drawn by the tier weights."""
        tiers = [t for t in TIERS if t in self.keys]
        if not tiers:
            raise ValueError(f"no API key given: set at least one of {', '.join(KEY_ENV.values())}")
        return rng.choices(tiers, weights=[self.tier_weights.get(t, 0.0) or 1e-9 for t in tiers])[0]


def auth(key: str) -> dict[str, str]:
    """The key in the X-API-Key header (the service also takes Authorization: Bearer)."""
    return {"X-API-Key": key}


def make_text(rng: random.Random, topic: str, n_words: int) -> str:
    """A headline-like text about ``topic``: topic words among filler."""
    words = [rng.choice(_TOPICS[topic]) if rng.random() < 0.45 else rng.choice(_FILLER) for _ in range(n_words)]
    return " ".join(words).capitalize() + "."


def _text_and_label(rng: random.Random, labels: Sequence[str]) -> tuple[str, str]:
    """A text of realistic length (mostly short, some long enough to be truncated) and its true label."""
    n_words = rng.choice((rng.randint(6, 16), rng.randint(20, 60), rng.randint(20, 60), rng.randint(200, 400)))
    by_name = {label.lower(): label for label in labels}
    topic = rng.choice(sorted(_TOPICS))
    if set(_TOPICS) <= set(by_name):  # an AG News model: the topic is the true label
        return make_text(rng, topic, n_words), by_name[topic]
    return make_text(rng, topic, n_words), (rng.choice(list(labels)) if labels else "")


def plan_classify(rng: random.Random, tier: str, cfg: MixConfig) -> Planned:
    """A valid /classify request of ``tier``: one or several texts, an explicit budget (in the body or the
    query), the tier's default, or a latency limit."""
    n = rng.randint(2, cfg.max_batch) if rng.random() < cfg.batch_share else 1
    pairs = [_text_and_label(rng, cfg.labels) for _ in range(n)]
    body: dict[str, Any] = {"texts": [t for t, _ in pairs]} if n > 1 else {"text": pairs[0][0]}
    path, kind = "/classify", "batch" if n > 1 else "single"
    r = rng.random()
    if r < cfg.latency_share:
        body["max_latency_ms"] = rng.choice(cfg.latency_limits_ms)
        kind += " max_latency_ms"
    elif r < cfg.latency_share + cfg.default_share:
        kind += " default budget"
    else:
        budget = rng.choice(cfg.budgets[tier])
        if rng.random() < 0.5:
            path = f"/classify?budget={budget}"
        else:
            body["budget"] = budget
    return Planned(name=f"{tier} {kind}", method="POST", path=path, expect="ok", headers=auth(cfg.keys[tier]),
                   json_body=body, true_labels=tuple(label for _, label in pairs))


def plan_feedback(request_id: str, index: int, label: str, key: str, tier: str) -> Planned:
    """POST /feedback with the true label of text ``index`` of an earlier answer (same key as the request)."""
    return Planned(name=f"{tier} feedback", method="POST", path="/feedback", expect="ok", headers=auth(key),
                   json_body={"request_id": request_id, "label": label, "index": index})


def _bad_bodies(rng: random.Random) -> list[tuple[str, Any]]:
    text = make_text(rng, "world", 8)
    return [
        ("empty text", {"text": "   "}),
        ("budget out of range", {"text": text, "budget": rng.choice((0.0, 1.5, -1, 7))}),
        ("budget not a number", {"text": text, "budget": "lots"}),
        ("text and texts", {"text": text, "texts": [text]}),
        ("too many texts", {"texts": [text] * 65}),
        ("unknown field", {"text": text, "temperature": 0.7}),
        ("wrong type", {"text": 42}),
        ("budget and max_latency_ms", {"text": text, "budget": 0.5, "max_latency_ms": 100}),
        ("negative max_latency_ms", {"text": text, "max_latency_ms": -5}),
        ("no text", {}),
    ]


def plan_bad(rng: random.Random, tier: str, cfg: MixConfig) -> Planned:
    """A request the service must refuse with a 4xx whatever its configuration (no missing key: a
    development configuration may let anonymous requests through)."""
    key = cfg.keys[tier]
    r = rng.random()
    if r < 0.1:
        return Planned(name="bad unknown key", method="POST", path="/classify", expect="client_error",
                       headers=auth("hb-not-a-key-" + format(rng.getrandbits(64), "x")),
                       json_body={"text": make_text(rng, "sports", 8)})
    if r < 0.2:
        return Planned(name="bad malformed json", method="POST", path="/classify", expect="client_error",
                       headers={**auth(key), "Content-Type": "application/json"},
                       raw_body=b'{"text": "unterminated')
    if r < 0.3:
        return Planned(name="bad feedback unknown request", method="POST", path="/feedback",
                       expect="client_error", headers=auth(key),
                       json_body={"request_id": format(rng.getrandbits(96), "x"), "label": "x"})
    if r < 0.35:
        return Planned(name="bad budget query out of range", method="POST", path="/classify?budget=nan",
                       expect="client_error", headers=auth(key), json_body={"text": make_text(rng, "business", 8)})
    kind, body = rng.choice(_bad_bodies(rng))
    return Planned(name=f"bad {kind}", method="POST", path="/classify", expect="client_error", headers=auth(key),
                   json_body=body)


def plan_next(rng: random.Random, tier: str, cfg: MixConfig) -> Planned:
    """The next request of a user of ``tier``: bad with probability ``bad_share``, else a good /classify."""
    if rng.random() < cfg.bad_share:
        return plan_bad(rng, tier, cfg)
    return plan_classify(rng, tier, cfg)


def body_bytes(plan: Planned) -> bytes:
    """The request body as sent."""
    if plan.raw_body is not None:
        return plan.raw_body
    return json.dumps(plan.json_body).encode()
