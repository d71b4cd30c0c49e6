"""Headless load test with pass/fail thresholds: locust runs loadtest/locustfile.py, this decides.

    python -m headbudget.loadtest.run --host http://127.0.0.1:8000 --users 20 --spawn-rate 10 --duration 60s \
        --key-balanced "$KEY" --max-error-rate 0.01 --max-p99-ms 250

Writes to --out: locust's CSV statistics (locust_stats.csv, locust_failures.csv, ...), report.html,
locust_stats.json and summary.json (measured figures, thresholds, verdict). Exit status: 0 when every threshold
holds, 1 when one is exceeded, 2 when the run could not be made (server not ready, no key, locust failed).
The error rate counts every request (a bad request answered 2xx or 5xx is an error; one answered 4xx is not);
the p99 is over good requests only, so that fast refusals do not flatter it.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from headbudget.client import Client, HeadbudgetError
from headbudget.commands.parser import OneLineParser
from headbudget.loadtest.mix import KEY_ENV, LABELS_ENV, TIERS

log = logging.getLogger("headbudget.loadtest")
LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass(frozen=True)
class Summary:
    """What a run measured, against which thresholds, and the verdict."""

    host: str
    users: int
    duration_s: float
    requests: int
    failures: int
    error_rate: float
    good_requests: int
    good_rps: float
    p50_ms: float | None
    p99_ms: float | None
    bad_requests: int
    bad_not_refused: int  # bad requests answered 2xx or 5xx
    by_name: dict[str, dict[str, float]]
    failure_reasons: dict[str, int]
    max_error_rate: float
    max_p99_ms: float
    passed: bool
    violations: list[str]


def parse_duration(text: str) -> float:
    """Seconds from "90", "20s", "2m" or "1m30s"."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if not parts or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"duration {text!r}: use seconds or e.g. 20s, 2m, 1m30s")
    h, m, s = (int(g or 0) for g in parts.groups())
    return float(h * 3600 + m * 60 + s)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m headbudget.loadtest.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="http://127.0.0.1:8000", help="base URL of the service")
    p.add_argument("--users", type=int, default=10, help="concurrent simulated clients")
    p.add_argument("--spawn-rate", type=float, default=5.0, help="users started per second")
    p.add_argument("--duration", type=parse_duration, default=60.0, help="e.g. 20s, 5m (default 60s)")
    for tier in TIERS:
        p.add_argument(f"--key-{tier}", default=os.environ.get(KEY_ENV[tier], ""),
                       help=f"API key of the {tier} tier (default ${KEY_ENV[tier]}); no key: no {tier} users")
    p.add_argument("--max-error-rate", type=float, default=0.01, help="fail above this share of failed requests")
    p.add_argument("--max-p99-ms", type=float, default=500.0, help="fail when good requests' p99 is above this")
    p.add_argument("--bad-share", type=float, default=None, help="share of deliberately bad requests (0.05)")
    p.add_argument("--feedback-share", type=float, default=None, help="share of answers given feedback (0.2)")
    p.add_argument("--wait", type=float, nargs=2, metavar=("MIN_S", "MAX_S"), default=None,
                   help="think time between a user's requests (default 0.05 0.5)")
    p.add_argument("--out", type=Path, default=None, help="report folder (default loadtest/reports/<time>)")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for /readyz")
    return p


def preflight(host: str, key: str, timeout_s: float) -> list[str]:
    """Wait for GET /readyz to say ready, then return the model's labels from /v1/models (for feedback with
    true labels; [] if they cannot be read). Uses the typed client, as any API consumer would."""
    with Client(host, api_key=key, timeout=5.0) as client:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                readiness = client.ready()
                if readiness.status == "ready":
                    break
                last = json.dumps(readiness.checks)
            except (httpx.HTTPError, ValueError) as e:
                last = str(e) or type(e).__name__
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host}/readyz not ready after {timeout_s:.0f} s ({last})")
            time.sleep(0.5)
        try:
            return list(client.models().data[0].labels)
        except (HeadbudgetError, httpx.HTTPError, ValueError, IndexError) as e:
            log.warning("could not read the model's labels from /v1/models (%s): no feedback will be sent", e)
            return []


def percentile_ms(response_times: dict[str, int], q: float) -> float | None:
    """The q-quantile of locust's response-time histogram (ms -> count, keys as JSON strings)."""
    points = sorted((float(k), n) for k, n in response_times.items())
    total = sum(n for _, n in points)
    if not total:
        return None
    rank, seen = math.ceil(q * total), 0
    for ms, n in points:
        seen += n
        if seen >= rank:
            return ms
    return points[-1][0]


def summarize(entries: list[dict[str, Any]], failures_csv: Path, args: argparse.Namespace) -> Summary:
    """Fold locust's per-name statistics into the figures the thresholds are checked against."""
    requests = sum(e["num_requests"] for e in entries)
    failures = sum(e["num_failures"] for e in entries)
    good = [e for e in entries if not e["name"].startswith("bad ")]
    bad = [e for e in entries if e["name"].startswith("bad ")]
    merged: dict[str, int] = {}
    for e in good:
        for ms, n in e["response_times"].items():
            merged[str(ms)] = merged.get(str(ms), 0) + n
    starts = [e["start_time"] for e in entries if e.get("start_time")]
    ends = [e["last_request_timestamp"] for e in entries if e.get("last_request_timestamp")]
    span = max(ends) - min(starts) if starts and ends else 0.0
    good_n = sum(e["num_requests"] for e in good)
    by_name = {e["name"]: {"requests": e["num_requests"], "failures": e["num_failures"],
                           "p50_ms": percentile_ms(e["response_times"], 0.5) or 0.0,
                           "p99_ms": percentile_ms(e["response_times"], 0.99) or 0.0} for e in entries}
    reasons: dict[str, int] = {}
    if failures_csv.is_file():
        with failures_csv.open(newline="") as f:
            for row in csv.DictReader(f):
                key = f"{row['Name']}: {row['Error']}"
                reasons[key] = reasons.get(key, 0) + int(row["Occurrences"])
    error_rate = failures / requests if requests else 1.0
    p99 = percentile_ms(merged, 0.99)
    violations = []
    if requests == 0:
        violations.append("no request was made")
    if error_rate > args.max_error_rate:
        violations.append(f"error rate {error_rate:.2%} above {args.max_error_rate:.2%}")
    if p99 is None or p99 > args.max_p99_ms:
        violations.append(f"p99 of good requests {p99} ms above {args.max_p99_ms:g} ms")
    return Summary(
        host=args.host, users=args.users, duration_s=args.duration, requests=requests, failures=failures,
        error_rate=error_rate, good_requests=good_n, good_rps=good_n / span if span > 0 else 0.0,
        p50_ms=percentile_ms(merged, 0.5), p99_ms=p99, bad_requests=sum(e["num_requests"] for e in bad),
        bad_not_refused=sum(e["num_failures"] for e in bad), by_name=by_name, failure_reasons=reasons,
        max_error_rate=args.max_error_rate, max_p99_ms=args.max_p99_ms, passed=not violations,
        violations=violations)


def locust_env(args: argparse.Namespace, labels: list[str]) -> dict[str, str]:
    """The locust process's environment: keys (never on its command line), labels and mix overrides."""
    env = dict(os.environ)
    for tier in TIERS:
        env.pop(KEY_ENV[tier], None)
        if getattr(args, f"key_{tier}"):
            env[KEY_ENV[tier]] = getattr(args, f"key_{tier}")
    env[LABELS_ENV] = ",".join(labels)
    if args.bad_share is not None:
        env["HEADBUDGET_LOAD_BAD_SHARE"] = str(args.bad_share)
    if args.feedback_share is not None:
        env["HEADBUDGET_LOAD_FEEDBACK_SHARE"] = str(args.feedback_share)
    if args.wait is not None:
        env["HEADBUDGET_LOAD_WAIT_MIN_S"], env["HEADBUDGET_LOAD_WAIT_MAX_S"] = (str(x) for x in args.wait)
    return env


def run_locust(args: argparse.Namespace, out: Path, env: dict[str, str]) -> Path:
    """Run locust headless for the duration; returns the path of its JSON statistics."""
    stats_json = out / "locust_stats.json"
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", args.host,
           "-u", str(args.users), "-r", str(args.spawn_rate), "-t", f"{math.ceil(args.duration)}s",
           "--stop-timeout", "10", "--csv", str(out / "locust"), "--html", str(out / "report.html"),
           "--json-file", str(stats_json.with_suffix("")), "--only-summary", "--exit-code-on-error", "0"]
    log.info("locust: %d users for %.0f s against %s", args.users, args.duration, args.host)
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.duration + 90)
    except subprocess.TimeoutExpired:
        raise RuntimeError("locust did not finish in time") from None
    if proc.returncode != 0 or not stats_json.is_file():
        raise RuntimeError(f"locust exited with status {proc.returncode}")
    return stats_json


def main(argv: list[str] | None = None) -> int:
    """Run the load test; 0 when the thresholds hold, 1 when not, 2 when the run could not be made."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    host = args.host.rstrip("/")
    args.host = host
    keys = [getattr(args, f"key_{t}") for t in TIERS if getattr(args, f"key_{t}")]
    if not keys:
        print("loadtest: error: no API key: give --key-cheap, --key-balanced or --key-quality", file=sys.stderr)
        return 2
    out = args.out or Path("loadtest/reports") / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    try:
        labels = preflight(host, keys[0], args.ready_timeout)
        stats_json = run_locust(args, out, locust_env(args, labels))
    except RuntimeError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    summary = summarize(json.loads(stats_json.read_text()), out / "locust_failures.csv", args)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    print(f"{summary.requests} requests ({summary.good_rps:.1f} good/s), error rate {summary.error_rate:.2%}, "
          f"p50 {summary.p50_ms} ms, p99 {summary.p99_ms} ms, {summary.bad_requests} bad requests "
          f"({summary.bad_not_refused} not refused); report: {out / 'report.html'}")
    for reason, n in sorted(summary.failure_reasons.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {n:6d}  {reason}")
    if not summary.passed:
        print("loadtest: FAILED: " + "; ".join(summary.violations), file=sys.stderr)
        return 1
    print("loadtest: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
