"""lab/compare_retime.py: a compare.json's baselines rebuilt as stand-ins of another checkpoint and re-timed.

The compare document is written here in compare's format (the fields retime reads), for a random whole-model
checkpoint, so that no baseline has to be trained to test the re-timing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from headbudget.experiments.compare.measure import engine_factory
from headbudget.models.checkpoint import load_checkpoint
from lab.compare_retime import main, retime

BUDGETS = [0.25, 0.75]
# The attention-only run's heads per layer (2 layers x 4 heads): nested, and not the (layer, head) order.
ATT_HEADS = {0.25: [1, 1], 0.75: [2, 4]}


def compare_doc(n_layers: int, intermediate_size: int, n_test: int) -> dict[str, Any]:
    """One seed of a ``compare --scope model`` on the synthetic task, with made-up accuracies."""
    results: dict[str, dict[str, Any]] = {"dense@1.00": {"method": "dense", "budget": 1.0, "accuracy": 0.9}}
    for b in [*BUDGETS, 1.0]:
        results[f"budgeted@{b:.2f}"] = {"method": "budgeted", "budget": b, "accuracy": 0.5 + 0.4 * b}
    for b in BUDGETS:
        results[f"attention-only@{b:.2f}"] = {"method": "attention-only", "budget": b, "accuracy": 0.4 + 0.4 * b,
                                              "heads_per_layer": ATT_HEADS[b]}
    results["layerdrop@1.00"] = {"method": "layerdrop", "budget": 1.0, "accuracy": 0.61, "n_layers": n_layers // 2}
    results["ffn-half@1.00"] = {"method": "ffn-half", "budget": 1.0, "accuracy": 0.62,
                                "neurons_per_layer": [intermediate_size // 2] * n_layers}
    return {"scope": "model", "data": "synthetic", "n_test": n_test, "budgets": BUDGETS, "command": "compare",
            "per_seed": {"7": {"results": results}}}


@pytest.fixture
def checkpoint_and_compare(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model_scope_checkpoint, ckpt, ignore=shutil.ignore_patterns("onnx"))
    model, _ = load_checkpoint(ckpt)
    doc = compare_doc(model.cfg.n_layers, model.cfg.intermediate_size, n_test=200)
    res = doc["per_seed"]["7"]["results"]
    sweep = {"n_examples": 200, "dense_accuracy": res["dense@1.00"]["accuracy"],
             "points": [{"budget": b, "accuracy_hard": 0.3 + 0.5 * b} for b in [0.1, *BUDGETS, 1.0]]}
    (ckpt / "sweep.json").write_text(json.dumps(sweep))
    return ckpt, doc


def test_retime_places_the_checkpoint_against_exact_standins(checkpoint_and_compare: tuple[Path, dict[str, Any]],
                                                             tmp_path: Path) -> None:
    ckpt, doc = checkpoint_and_compare
    res = doc["per_seed"]["7"]["results"]
    factory = engine_factory("onnxruntime", tuple(BUDGETS))
    got = retime(ckpt, doc, tmp_path / "work", factory, 5, 1)
    assert {(r["method"], r["budget"]) for r in got["placement"]} == (
        {("layerdrop", 1.0), ("ffn-half", 1.0)} | {("attention-only", b) for b in BUDGETS})
    timed = got["per_seed"]["7"]["results"]
    assert all(r["latency_ms"] > 0 for r in timed.values())
    assert timed["layerdrop@1.00"]["accuracy"] == res["layerdrop@1.00"]["accuracy"]  # compare's accuracies
    assert timed["budgeted@0.25"]["accuracy"] == pytest.approx(0.3 + 0.5 * 0.25)  # the checkpoint's sweep
    # The stand-ins time what the baselines run: their shapes, and the attention-only run's plans exactly.
    att, _ = load_checkpoint(tmp_path / "work" / "attention-only")
    assert att.cfg.gate.scope == "attention"
    for b in BUDGETS:
        assert [int(x) for x in att.gates.hard_mask(b).sum(1)] == ATT_HEADS[b]
    layerdrop, _ = load_checkpoint(tmp_path / "work" / "layerdrop")
    half, _ = load_checkpoint(tmp_path / "work" / "ffn-half")
    assert layerdrop.cfg.n_layers == res["layerdrop@1.00"]["n_layers"] and layerdrop.cfg.gate.scope == "attention"
    assert [half.cfg.intermediate_size] * half.cfg.n_layers == res["ffn-half@1.00"]["neurons_per_layer"]


def test_retime_refuses_another_lineage(checkpoint_and_compare: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ckpt, doc = checkpoint_and_compare
    sweep = json.loads((ckpt / "sweep.json").read_text())
    sweep["dense_accuracy"] += 0.01  # another dense model: its baselines are not this checkpoint's
    (ckpt / "sweep.json").write_text(json.dumps(sweep))
    with pytest.raises(ValueError, match="lineage"):
        retime(ckpt, doc, tmp_path / "work", engine_factory("onnxruntime", tuple(BUDGETS)), 5, 1)
    assert not (tmp_path / "work").exists()  # refused before any stand-in is written


def test_retime_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--compare", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "none.json" in err and "\n" not in err
