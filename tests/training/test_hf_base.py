"""`headbudget train --base <fine-tuned Hugging Face classifier>`: the dense stage is skipped and said so."""

from __future__ import annotations

import json
from pathlib import Path

from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from tests.conftest import run_cli
from tests.models.test_pretrained import hf_classifier

SHORT = ("--set", "budget_epochs=1", "--set", "synthetic_size=400", "--no-sweep", "--device", "cpu")


def test_a_roberta_classifier_becomes_a_budgeted_checkpoint_that_serves(tmp_path: Path) -> None:
    hf_classifier("roberta", tmp_path / "hf", labels=("same", "different"))  # the synthetic task's labels
    out = tmp_path / "budgeted"
    proc = run_cli("train", "--base", str(tmp_path / "hf"), "--data", "synthetic", "--recipe", "smoke",
                   "--out", str(out), *SHORT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stage dense: skipped, roberta sequence classifier" in proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["stages"]["dense"]["steps"] == 0 and "classifier" in config["stages"]["dense"]["skipped"]
    assert config["stages"]["budget"]["steps"] > 0 and config["model"]["pooler"] == "tanh"
    engine = load_engine(out, EngineOptions(cache_dir=tmp_path / "cache"))
    try:
        half, full = engine.predict(["one two three", "four five"], 0.5), engine.predict(["one two"], 1.0)
    finally:
        engine.close()
    assert {p.label for p in half.predictions} <= {"same", "different"}
    assert half.heads_active < full.heads_active == full.heads_total == 8


def test_an_unsupported_base_is_one_line(tmp_path: Path) -> None:
    hf_classifier("bert", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "electra"}))
    proc = run_cli("train", "--base", str(tmp_path / "hf"), "--data", "synthetic", "--recipe", "smoke",
                   "--out", str(tmp_path / "out"), *SHORT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "model_type 'electra' is not supported" in proc.stderr
