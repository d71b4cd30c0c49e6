"""schemathesis against a running server: every route of its published OpenAPI document, once per tier key.

Every check schemathesis has runs, and ``checks.budget_within_tier``, except ``positive_data_acceptance``: the
service refuses some requests the document cannot describe as invalid (both `text` and `texts`, a budget in the
query and in the body, `max_budget` beside a numeric budget, a feedback label the model does not have), which
OpenAPI cannot state across query, header and body.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.hostile.checks import TIER_MAX

SERVER_ERRORS = {"ST101", "ST102"}  # a 5xx, or a 5xx's wrong content type
CUSTOM = {"ST901"}  # our checks: an answer the service promises never to give
ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("schemathesis.toml")


@dataclass
class SchemaReport:
    """Counts over every tier's run: cases sent, failures by kind, and the failures themselves."""

    cases: int = 0
    server_errors: int = 0
    schema_violations: int = 0
    impossible_answers: int = 0
    routes: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"cases": self.cases, "server_errors": self.server_errors,
                "schema_violations": self.schema_violations, "impossible_answers": self.impossible_answers,
                "routes": self.routes, "failures": self.failures}


def run_schemathesis(url: str, keys: dict[str, str], tier_max: dict[str, float], out: Path, *,
                     max_examples: int, seed: int = 1, max_time_s: float | None = None,
                     timeout_s: float = 3600) -> SchemaReport:
    """``schemathesis run`` once per (tier, key), its JSON reports in ``out``; the counts added up."""
    out.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).with_name("schemathesis")
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "lab.hostile.checks", TIER_MAX: json.dumps(tier_max),
           "PYTHONPATH": str(ROOT)}
    report = SchemaReport()
    for tier, key in keys.items():
        path = out / f"schemathesis-{tier}.json"
        cmd = [str(exe), "--config-file", str(CONFIG), "run", f"{url}/openapi.json", "-H", f"X-API-Key: {key}", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "--max-examples", str(max_examples),
               "--seed", str(seed), "--workers", "1", "--report", "json", "--report-json-path", str(path),
               *(["--max-time", str(int(max_time_s))] if max_time_s else [])]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        (out / f"schemathesis-{tier}.log").write_text(proc.stdout + proc.stderr)
        if not path.exists():
            raise RuntimeError(f"schemathesis wrote no report (exit {proc.returncode}): {proc.stderr[-500:]}")
        run = json.loads(path.read_text())
        report.cases += int(run["test_cases"]["generated"])
        report.routes = max(report.routes, int(run["operations"]["tested"]))
        if run["errors"]:
            raise RuntimeError(f"schemathesis errored: {json.dumps(run['errors'])[:500]}")
        for failure in run["failures"]:
            code, count = failure["code"], int(failure.get("count", 1))
            if code in SERVER_ERRORS:
                report.server_errors += count
            elif code in CUSTOM:
                report.impossible_answers += count
            else:
                report.schema_violations += count
            report.failures.append({"tier": tier, **failure})
    return report
