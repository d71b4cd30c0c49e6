"""Locust scenario for headbudget: a realistic mix of tiers, budgets, latency limits, batches and bad requests.

Each simulated user is one API client of one tier (drawn by weight among the tiers with a key in
HEADBUDGET_KEY_CHEAP / _BALANCED / _QUALITY). It sends /classify requests (single texts and batches; explicit
budgets in the query or the body, the tier's default, or max_latency_ms), reports the true label of a share of
its answers on /feedback, and sends a share of bad requests that must be refused:

- a good request passes on 2xx with a well-formed answer; anything else is a failure (429 and 503 included);
- a bad request passes on 4xx; a 2xx or a 5xx is a failure.

Headless with thresholds: ``python -m headbudget.loadtest.run`` (loadtest/run.py). Interactive:
``locust -f loadtest/locustfile.py --host http://127.0.0.1:8000`` (or the compose `locust` service).
"""

from __future__ import annotations

import os
import random
from typing import Any

from locust import between, events, task
from locust.contrib.fasthttp import FastHttpUser

try:
    from headbudget.loadtest.mix import MixConfig, Planned, body_bytes, plan_feedback, plan_next
except ImportError:  # the compose locust container mounts this folder without the headbudget package
    from mix import MixConfig, Planned, body_bytes, plan_feedback, plan_next  # type: ignore[import-not-found,no-redef]

CONFIG = MixConfig.from_env()


@events.test_start.add_listener
def _check_keys(environment: Any, **_: Any) -> None:
    if not CONFIG.keys:
        raise RuntimeError("no API key: set HEADBUDGET_KEY_CHEAP, HEADBUDGET_KEY_BALANCED or HEADBUDGET_KEY_QUALITY")


def _answer_problem(plan: Planned, body: Any) -> str | None:
    """Why a 2xx /classify answer is malformed, or None."""
    if not isinstance(body, dict) or not isinstance(body.get("results"), list):
        return "answer has no results list"
    if len(body["results"]) != len(plan.true_labels):
        return f"{len(body['results'])} results for {len(plan.true_labels)} texts"
    for r in body["results"]:
        if not isinstance(r, dict) or "label" not in r or "budget_applied" not in r:
            return "a result lacks label or budget_applied"
        requested = r.get("budget_requested", 1.0)
        requested = 1.0 if requested == "auto" else requested  # auto: the model's own choice, at most every head
        if r["budget_applied"] > requested + 1e-9:
            return "budget_applied above budget_requested"
    if not body.get("request_id"):
        return "answer has no request_id"
    return None


class ApiClient(FastHttpUser):
    """One API key of one tier, sending the mix of loadtest/mix.py."""

    wait_time = between(float(os.environ.get("HEADBUDGET_LOAD_WAIT_MIN_S", "0.05")),
                        float(os.environ.get("HEADBUDGET_LOAD_WAIT_MAX_S", "0.5")))
    network_timeout = 30.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        self.rng = random.Random()
        self.tier = CONFIG.pick_tier(self.rng)

    def send(self, plan: Planned) -> Any:
        """Send ``plan``; mark success or failure by its expectation; the parsed body of a good 2xx, else None."""
        headers = dict(plan.headers)
        headers.setdefault("Content-Type", "application/json")
        with self.client.request(plan.method, plan.path, data=body_bytes(plan), headers=headers, name=plan.name,
                                 catch_response=True) as resp:
            status = resp.status_code or 0
            if plan.expect == "client_error":
                if 400 <= status < 500:
                    resp.success()
                else:
                    resp.failure(f"bad request answered {status}, expected 4xx")
                return None
            if not 200 <= status < 300:
                code = _error_code(resp)
                resp.failure(f"{status} {code}".strip())
                return None
            try:
                body = resp.json()
            except ValueError:
                resp.failure("2xx answer is not JSON")
                return None
            problem = _answer_problem(plan, body) if plan.path.startswith("/classify") else None
            if problem:
                resp.failure(problem)
                return None
            resp.success()
            return body

    @task
    def classify(self) -> None:
        """One request of the mix, then feedback on one of its texts with probability feedback_share."""
        plan = plan_next(self.rng, self.tier, CONFIG)
        body = self.send(plan)
        if body is None or not CONFIG.labels or self.rng.random() >= CONFIG.feedback_share:
            return
        index = self.rng.randrange(len(plan.true_labels))
        self.send(plan_feedback(body["request_id"], index, plan.true_labels[index], CONFIG.keys[self.tier],
                                self.tier))


def _error_code(resp: Any) -> str:
    """The API's error code from an error body, if any."""
    try:
        return str(resp.json()["error"]["code"])
    except Exception:  # not JSON, or not our error shape (e.g. a proxy's page)
        return ""
