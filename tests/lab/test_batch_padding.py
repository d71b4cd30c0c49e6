"""The padding investigation on a tiny checkpoint: every mode and size gets a row, and the tokens each mode runs
follow its grouping (values, not speed)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from headbudget.engine import passes
from lab.batch_padding import main


def _data(folder: Path) -> Path:
    folder.mkdir()
    with open(folder / "test.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(12):
            w.writerow([" ".join(["oil prices rose as markets fell"] * (1 + 3 * (i % 4))), "0"])
    return folder


def test_rows_for_every_mode_and_the_tokens_they_run(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "padding.json"
    assert main(["--model", str(tiny_model_scope_checkpoint), "--data", str(_data(tmp_path / "d")), "--out", str(out),
                 "--budgets", "1.0", "--sizes", "1", "4", "--pad-shares", "0", "0.125", "--rounds", "1",
                 "--precision", "fp32"]) == 0
    doc = json.loads(out.read_text())
    assert doc["texts"] == 12 and doc["command"].startswith("python -m lab.batch_padding")
    rows = {(r["batch"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {(1, "one_at_a_time")} | {(4, m) for m in ("one_at_a_time", "padded_to_longest",
                                                                   "by_length_0", "by_length_0.125")}
    assert all(r["cpu_ms_per_text"] > 0 for r in rows.values())
    assert rows[(4, "one_at_a_time")]["padded_over_own"] == 1.0 == rows[(4, "by_length_0")]["padded_over_own"]
    # texts of 1 to 10 repeats in batches of 4: one pass pads them to the longest, by length within the share
    assert rows[(4, "padded_to_longest")]["padded_over_own"] > 1.5
    assert rows[(4, "by_length_0.125")]["padded_over_own"] <= 1 + passes.PAD_SHARE


def test_an_output_folder_that_does_not_exist_is_one_line(tmp_path: Path, capsys: object) -> None:
    assert main(["--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "no" / "x.json")]) == 2
