"""The service benchmark's overhead phase against a real server (smoke checkpoint): it runs, and its figures
are consistent with each other (values, not speed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from headbudget.loadtest.service_bench import main, overhead


def test_overhead_phase_on_a_real_server(smoke_checkpoint: Path) -> None:
    texts = [f"red marker four pink blue {i} green marker two" for i in range(12)]
    r = overhead(smoke_checkpoint, texts, 0.5, 3.0)
    assert r["n_requests"] == 12 and r["client"] == "http.client keep-alive"
    assert r["rtt_median_ms"] > r["server_handler_median_ms"] >= r["server_forward_median_ms"] > 0
    assert r["healthz_rtt_median_ms"] > 0 and r["engine_median_ms"] > 0
    assert math.isfinite(r["overhead_median_ms"])
    assert r["overhead_p99_ms"] >= r["overhead_median_ms"]


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("service_bench: error:") and err.count("\n") == 1
