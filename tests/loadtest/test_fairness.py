"""The fairness load test at a small scale against a real 2-worker server (tiny checkpoint): it writes every figure
with its provenance, nothing is answered 5xx, and the heavy key is refused over its compute quota with Retry-After
(values and shape, not speed)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from headbudget.loadtest.fairness import main, to_toml

SERVICE_TOML = Path(__file__).resolve().parents[2] / "service.toml"


def test_fairness_run_writes_its_figures_and_nothing_is_5xx(tiny_checkpoint: Path, tmp_path: Path) -> None:
    config = tomllib.loads(SERVICE_TOML.read_text(encoding="utf-8"))
    config["tiers"]["cheap"].update(
        # The shipped tiers, but a target this shared test machine's speed cannot miss: a 503 here would measure
        # the machine, not the queue.
        latency_target_ms=2000,
        # Two of the heavy key's requests (64 texts of 128 tokens at 0.25: 5,120 units each), then 429.
        compute_per_minute=12000, compute_burst=12000, max_request_compute=12000)
    cfg = tmp_path / "service.toml"
    cfg.write_text(to_toml(config))
    out = tmp_path / "fairness.json"
    rc = main(["--model", str(tiny_checkpoint), "--config", str(cfg), "--out", str(out), "--seconds", "3",
               "--light-rps", "5", "--long-words", "200", "--precision", "fp32"])
    doc = json.loads(out.read_text())
    assert rc == (0 if doc["light_within_bound"] else 1)
    for k in ("light_p99_alone_ms", "light_p99_with_heavy_ms", "longest_pass_ms", "light_p99_bound_ms"):
        assert isinstance(doc[k], float) and doc[k] > 0, k
    assert doc["light_p99_bound_ms"] == pytest.approx(1.5 * doc["light_p99_alone_ms"] + doc["longest_pass_ms"],
                                                      abs=2e-3)
    assert doc["longest_pass_ms"] == max(doc["light_longest_pass_ms"], doc["heavy_longest_pass_ms"])
    counts = doc["status_counts"]
    assert set(counts) == {"light_alone", "light", "heavy"}
    assert not [s for c in counts.values() for s in c if not s.startswith(("2", "4"))], counts  # no 5xx, no drops
    assert doc["server_errors"] == 0
    assert set(counts["light_alone"]) == set(counts["light"]) == {"200"}  # under its rate and its quota
    assert sum(counts["light_alone"].values()) == sum(counts["light"].values()) == 15  # 5 a second for 3 s
    assert counts["heavy"].get("200", 0) >= 1 and counts["heavy"].get("429", 0) >= 1
    assert doc["retry_after_counts"]["heavy"]["429"] == counts["heavy"]["429"]  # every 429 says when to come back
    assert doc["pass_ms_max"] == doc["longest_pass_ms"] and doc["light_non200"] == 0
    heavy_answers = counts["heavy"]["200"]
    assert doc["heavy_answers_per_min"] > 0 and doc["heavy_units_per_min"] == pytest.approx(
        doc["heavy_answers_per_min"] * doc["heavy_charge_units"], rel=1e-3)  # one text length: one charge
    assert heavy_answers >= 1
    assert doc["heavy_tokens_per_text"] == 128 and doc["heavy_charge_units"] > 100 * doc["light_charge_units"]
    setup = doc["setup"]
    assert setup["workers"] == 2 and setup["tier"] == "cheap" and setup["tier_settings"]["compute_per_minute"] == 12000
    assert doc["machine"] and re.fullmatch(r"\d{4}-\d\d-\d\d", doc["date"])
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", doc["commit"])
    assert doc["command"].startswith("python -m headbudget.loadtest.fairness --model ")
    assert doc["checkpoint"] == str(tiny_checkpoint)


@pytest.mark.parametrize("flags", [[], ["--light-rps", "0"], ["--seconds", "nan"], ["--heavy-texts", "65"]])
def test_bad_input_is_one_line(flags: list[str], tiny_checkpoint: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path if not flags else tiny_checkpoint  # no flags: a folder that is no checkpoint
    assert main(["--model", str(model), "--config", str(SERVICE_TOML), "--out", str(tmp_path / "x.json"),
                 *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairness: error:") and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()
