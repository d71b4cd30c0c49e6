"""budget=auto through a real server against fixed budgets of the same mean cost: the measurement runs end to
end on a smoke checkpoint with a cascade decider, and its figures are consistent (values, not speed)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from headbudget.engine.artifacts import checkpoint_digest
from headbudget.engine.decider import CascadePoint, Decider, DeciderKind, save_decider
from headbudget.loadtest.auto_latency import bracket, main


def test_bracket_takes_the_grid_pair_around_the_target() -> None:
    fixed = {0.1: 0.09, 0.15: 0.16, 0.2: 0.21}
    assert bracket(0.18, fixed) == (0.15, 0.2)
    assert bracket(0.05, fixed) == (0.1, 0.15) and bracket(0.5, fixed) == (0.15, 0.2)


def test_auto_against_fixed_budgets_on_a_real_server(smoke_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(smoke_model_scope_checkpoint, folder, ignore=shutil.ignore_patterns("onnx"))
    labels = tuple(json.loads((folder / "config.json").read_text())["model"]["labels"])
    # A cascade whose threshold no answer reaches: every text runs 0.25, then 0.5.
    point = CascadePoint(0.5, 0.5, 0.9, stages=(0.25, 0.5), thresholds=(1.01,))
    save_decider(Decider(DeciderKind.CASCADE, (point,), 0, checkpoint_digest(folder), labels), folder)
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "test.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows([f"red marker four pink blue {i} green marker two", labels[0]] for i in range(40))
    out = tmp_path / "auto.json"
    assert main(["--model", str(folder), "--data", str(data), "--requests", "12", "--rounds", "1",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    lo, hi = (f["budget"] for f in doc["fixed"])
    assert hi == pytest.approx(lo + 0.05)
    assert doc["auto"]["mean_passes"] == 2 and doc["auto"]["mean_ms"] > 0 and doc["n_texts"] == 12
    # both passes are counted: auto costs more than fixed b = 0.5, so the pair bracketing it lies above 0.5
    assert lo >= 0.5 and doc["fixed"][0]["mean_cost"] <= doc["auto"]["mean_cost"] <= doc["fixed"][1]["mean_cost"]
    assert doc["fixed_mean_ms_at_auto_cost"] > 0
    assert doc["auto_over_fixed"] == pytest.approx(doc["auto"]["mean_ms"] / doc["fixed_mean_ms_at_auto_cost"])


def test_a_checkpoint_without_a_decider_is_one_line(smoke_model_scope_checkpoint: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.csv").write_text("text,label\nhello there,a\n")
    with pytest.raises(SystemExit, match="has no usable decider.json"):
        main(["--model", str(smoke_model_scope_checkpoint), "--data", str(data), "--requests", "1",
              "--out", str(tmp_path / "x.json")])
