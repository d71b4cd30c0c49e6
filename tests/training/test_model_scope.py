"""`headbudget train --scope model` end to end on the smoke setting: the sweep over heads and neurons, the
checkpoint's config, resuming, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.plan import Shape
from tests.conftest import run_cli
from tests.training.test_cli import SMOKE_MIN_ACCURACY_B05


def test_smoke_model_scope_trains_and_sweeps_heads_and_neurons(smoke_model_scope_checkpoint: Path) -> None:
    folder = smoke_model_scope_checkpoint
    sweep = json.loads((folder / "sweep.json").read_text())
    assert sweep["scope"] == "model" and sweep["ffn_group"] == 64 and sweep["ref_length"] == 128
    assert len(sweep["points"]) == 19 and sweep["nested"] is True and sweep["soft_cost_monotone"] is True
    model, config = load_checkpoint(folder)
    assert config["model"]["gate"]["scope"] == "model" and tuple(model.gates.logit.shape) == (2, 4 + 4)
    previous_heads, previous_neurons = [0, 0], [0, 0]
    for p in sweep["points"]:
        b = p["budget"]
        assert p["hard_cost"] <= b + 1e-9  # the kept units' MACs never exceed the budget's share
        plan = model.gates.policy().plan(b)
        assert p["neurons_per_layer"] == list(plan.ffn or ()) and p["heads_per_layer"] == list(plan.heads)
        assert p["macs_fraction"] == pytest.approx(plan.cost(Shape.of(model.cfg), 128).ratio)
        assert all(x >= y for x, y in zip(p["heads_per_layer"], previous_heads, strict=True))
        assert all(x >= y for x, y in zip(p["neurons_per_layer"], previous_neurons, strict=True))
        previous_heads, previous_neurons = p["heads_per_layer"], p["neurons_per_layer"]
    half = next(p for p in sweep["points"] if p["budget"] == 0.5)
    assert half["accuracy_hard"] >= SMOKE_MIN_ACCURACY_B05
    assert sweep["points"][-1]["neurons_active"] == sweep["points"][-1]["neurons_total"] == 2 * 256
    assert sweep["points"][0]["neurons_active"] < 2 * 256 or sweep["points"][0]["heads_active"] < 8


def test_model_scope_resumes_and_an_attention_run_may_not_reuse_its_folder(
        smoke_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    run = shutil.copytree(smoke_model_scope_checkpoint, tmp_path / "run")  # a resume rewrites the folder
    proc = run_cli("train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", "--scope", "model",
                   "--out", str(run), "--device", "cpu", "--no-sweep")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("already done") == 3
    other = run_cli("train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", "--scope", "attention",
                    "--out", str(run), "--device", "cpu", "--no-sweep")
    assert other.returncode != 0 and "different run" in other.stderr


@pytest.mark.parametrize(("extra", "message"), [
    (["--structural"], "structural mode"),
    (["--model", "span"], "for the budgeted model type"),
    (["--scope", "layers"], "invalid choice"),
])
def test_a_scope_that_cannot_apply_is_one_line(extra: list[str], message: str, tmp_path: Path) -> None:
    args = ["train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", "--out", str(tmp_path / "x"),
            "--device", "cpu", "--no-sweep"]
    proc = run_cli(*args, *(["--scope", "model"] if "--scope" not in extra else []), *extra)
    assert proc.returncode != 0 and message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
