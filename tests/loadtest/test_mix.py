"""The load test's request mix: good requests are valid API requests within each tier, bad ones are not."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from pydantic import ValidationError

from headbudget.loadtest.mix import (
    DEFAULT_BUDGETS,
    MixConfig,
    body_bytes,
    plan_bad,
    plan_classify,
    plan_feedback,
    plan_next,
)
from headbudget.service.http.schemas import MAX_TEXTS, ClassifyRequest, FeedbackRequest
from headbudget.service.settings import load_config

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"cheap": "k-cheap", "balanced": "k-balanced", "quality": "k-quality"}
AG_LABELS = ("World", "Sports", "Business", "Sci/Tech")


def _request(plan) -> ClassifyRequest:
    """The ClassifyRequest the service would build from a plan (query budget merged into the body)."""
    body = json.loads(body_bytes(plan))
    query = parse_qs(urlsplit(plan.path).query)
    if "budget" in query:
        body["budget"] = float(query["budget"][0])
    return ClassifyRequest.model_validate(body)


@pytest.mark.parametrize("tier", sorted(KEYS))
def test_good_plans_are_valid_requests_within_the_tier(tier: str) -> None:
    cfg = MixConfig(keys=KEYS, labels=AG_LABELS)
    rng = random.Random(1)
    kinds = Counter()
    for _ in range(1500):
        plan = plan_classify(rng, tier, cfg)
        req = _request(plan)
        assert plan.expect == "ok" and plan.headers == {"X-API-Key": KEYS[tier]}
        assert len(req.all_texts()) == len(plan.true_labels) <= MAX_TEXTS
        assert set(plan.true_labels) <= set(AG_LABELS)
        if isinstance(req.budget, float):
            assert req.budget in DEFAULT_BUDGETS[tier]
        kinds[plan.name.removeprefix(f"{tier} ")] += 1
    # Every shape of request appears: single and batched, explicit budget, tier default, latency limit.
    assert {"single", "batch", "single default budget", "batch default budget", "single max_latency_ms",
            "batch max_latency_ms"} <= set(kinds)
    assert 0.12 < (kinds["batch"] + kinds["batch default budget"] + kinds["batch max_latency_ms"]) / 1500 < 0.28


@pytest.mark.parametrize("config", ["docker/service.toml", "docker/service.compose.toml",
                                    "deploy/kubernetes/base/service.toml"])
def test_default_budgets_are_within_every_shipped_tier(config: str) -> None:
    cfg = load_config(ROOT / config)
    for tier, budgets in DEFAULT_BUDGETS.items():
        assert max(budgets) <= cfg.tier(tier).max_budget, (config, tier)


def test_bad_plans_are_refused_by_validation_or_auth() -> None:
    cfg = MixConfig(keys=KEYS, labels=AG_LABELS)
    rng = random.Random(2)
    names = set()
    for _ in range(2000):
        plan = plan_bad(rng, "balanced", cfg)
        names.add(plan.name)
        assert plan.expect == "client_error"
        if plan.name == "bad unknown key":
            assert plan.headers["X-API-Key"] not in KEYS.values()
            continue
        if plan.name == "bad malformed json":
            with pytest.raises(ValueError):
                json.loads(body_bytes(plan))
            continue
        if plan.name == "bad feedback unknown request":
            FeedbackRequest.model_validate(plan.json_body)  # well-formed, but no such request id: 404
            continue
        with pytest.raises((ValidationError, ValueError)):
            _request(plan)
    assert len(names) >= 12


def test_bad_share_and_feedback_plans() -> None:
    cfg = MixConfig(keys={"cheap": "k"}, labels=("negative", "positive"), bad_share=0.1)
    rng = random.Random(3)
    plans = [plan_next(rng, "cheap", cfg) for _ in range(3000)]
    share = sum(p.expect == "client_error" for p in plans) / len(plans)
    assert 0.08 < share < 0.12
    good = next(p for p in plans if p.expect == "ok")
    assert set(good.true_labels) <= {"negative", "positive"}
    fb = plan_feedback("abc123", 0, "positive", "k", "cheap")
    assert FeedbackRequest.model_validate(fb.json_body).label == "positive"
    assert fb.headers == {"X-API-Key": "k"} and fb.name == "cheap feedback"


def test_config_from_env_reads_keys_labels_and_overrides() -> None:
    cfg = MixConfig.from_env({"HEADBUDGET_KEY_BALANCED": "kb", "HEADBUDGET_KEY_QUALITY": "kq",
                              "HEADBUDGET_LOAD_LABELS": "a,b", "HEADBUDGET_LOAD_BAD_SHARE": "0.5",
                              "HEADBUDGET_LOAD_BUDGETS_QUALITY": "0.9,1.0"})
    assert dict(cfg.keys) == {"balanced": "kb", "quality": "kq"}
    assert cfg.labels == ("a", "b") and cfg.bad_share == 0.5 and cfg.budgets["quality"] == (0.9, 1.0)
    rng = random.Random(4)
    assert {cfg.pick_tier(rng) for _ in range(200)} == {"balanced", "quality"}
    with pytest.raises(ValueError, match="HEADBUDGET_KEY_"):
        MixConfig.from_env({}).pick_tier(rng)


def test_locustfile_loads_without_the_headbudget_package(tmp_path: Path) -> None:
    """As in the compose locust container: locustfile.py and mix.py in a folder, no headbudget installed.
    (A subprocess: importing locust monkey-patches the standard library with gevent.)"""
    import shutil
    import subprocess
    import sys

    for name in ("locustfile.py", "mix.py"):
        shutil.copy(ROOT / "loadtest" / name, tmp_path / name)
    code = ("import sys; sys.modules['headbudget'] = None; sys.path.insert(0, sys.argv[1]); import locustfile; "
            "assert locustfile.CONFIG.keys == {'balanced': 'kb'}; print(locustfile.ApiClient.__name__)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HEADBUDGET_KEY_BALANCED": "kb"}, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ApiClient", proc.stderr[-2000:]
