"""The headless runner: its arithmetic, its exit codes, and a bounded run (about 20 s, loopback only) of the
locust mix against the real service."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from headbudget.loadtest.run import parse_duration, percentile_ms, summarize
from tests.ops.live import KEYS, LiveService, free_port

RUN = [sys.executable, "-m", "headbudget.loadtest.run"]


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The runner in its own process group, killed with its locust child if it overruns ``timeout``."""
    proc = subprocess.Popen([*RUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the runner overran {timeout} s:\n{out[-2000:]}{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _keys() -> list[str]:
    return [arg for tier, key in KEYS.items() for arg in (f"--key-{tier}", key)]


def test_parse_duration() -> None:
    assert parse_duration("20s") == 20 and parse_duration("2m") == 120 and parse_duration("1m30s") == 90
    assert parse_duration("45") == 45 and parse_duration("1h") == 3600
    for bad in ("", "soon", "5x", "m"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)


def test_percentile_of_locust_histogram() -> None:
    hist = {"10": 50, "20": 40, "300": 9, "2000": 1}
    assert percentile_ms(hist, 0.5) == 10 and percentile_ms(hist, 0.9) == 20
    assert percentile_ms(hist, 0.99) == 300 and percentile_ms(hist, 1.0) == 2000
    assert percentile_ms({}, 0.99) is None


def _entry(name: str, n: int, failures: int, times: dict[str, int]) -> dict:
    return {"name": name, "method": "POST", "num_requests": n, "num_failures": failures, "response_times": times,
            "start_time": 100.0, "last_request_timestamp": 110.0}


def test_summary_excludes_bad_requests_from_p99_and_counts_every_failure(tmp_path: Path) -> None:
    args = argparse.Namespace(host="http://127.0.0.1:1", users=2, duration=10.0, max_error_rate=0.05,
                              max_p99_ms=100.0)
    entries = [_entry("balanced single", 100, 1, {"40": 99, "90": 1}),
               _entry("bad empty text", 10, 0, {"1": 10}), _entry("bad unknown key", 5, 2, {"2000": 5})]
    failures = tmp_path / "failures.csv"
    failures.write_text("Method,Name,Error,Occurrences\nPOST,bad unknown key,bad request answered 200,2\n")
    s = summarize(entries, failures, args)
    assert s.requests == 115 and s.failures == 3 and s.bad_requests == 15 and s.bad_not_refused == 2
    assert s.p99_ms == 40 and s.good_rps == 10.0  # the slow bad requests do not count in the p99
    assert s.passed and s.failure_reasons == {"bad unknown key: bad request answered 200": 2}
    strict = summarize(entries, failures, argparse.Namespace(**{**vars(args), "max_p99_ms": 30.0,
                                                                "max_error_rate": 0.01}))
    assert not strict.passed and len(strict.violations) == 2


def test_exits_2_without_a_key_or_a_ready_server(tmp_path: Path) -> None:
    proc = run(["--host", "http://127.0.0.1:9", "--out", str(tmp_path)], 60, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "no API key" in proc.stderr
    proc = run(["--host", f"http://127.0.0.1:{free_port()}", "--ready-timeout", "1", "--key-cheap", "k",
                "--out", str(tmp_path)], 60)
    assert proc.returncode == 2 and "not ready" in proc.stderr


@pytest.mark.slow
def test_bounded_run_against_the_real_service(live_service: LiveService, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = run(["--host", live_service.url, "--users", "6", "--spawn-rate", "6", "--duration", "20s", *_keys(),
                "--max-error-rate", "0.01", "--max-p99-ms", "5000", "--bad-share", "0.1", "--out", str(out)], 180)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + json.dumps(summary, indent=1)
    assert summary["passed"] and summary["requests"] >= 100
    assert summary["bad_requests"] > 0 and summary["bad_not_refused"] == 0
    names = set(summary["by_name"])
    assert any(n.endswith(" batch") for n in names) and any("max_latency_ms" in n for n in names)
    assert any(n.endswith(" feedback") for n in names) and sum(n.startswith("bad ") for n in names) >= 3
    for report in ("report.html", "locust_stats.csv", "locust_failures.csv", "locust_stats_history.csv"):
        assert (out / report).is_file(), report
    assert "locust" in (out / "report.html").read_text().lower()


@pytest.mark.slow
def test_exits_1_when_a_threshold_is_exceeded(live_service: LiveService, tmp_path: Path) -> None:
    proc = run(["--host", live_service.url, "--users", "2", "--spawn-rate", "2", "--duration", "4s",
                "--key-balanced", KEYS["balanced"], "--max-p99-ms", "0.001", "--out", str(tmp_path)], 120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["passed"] and any("p99" in v for v in summary["violations"])
