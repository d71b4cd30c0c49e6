"""Stage-3 options: the dense teacher, hidden-state distillation and the sandwich rule."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest
import torch

from headbudget.models.config import GateConfig
from headbudget.models.model_types import REGISTRY
from headbudget.models.pretrained import random_init
from headbudget.training.recipes import RunConfig, get_recipe, parse_overrides
from headbudget.training.stages import STAGES, Stage, _stage_loss
from tests.conftest import run_cli

LABELS = ("a", "b", "c")


def test_each_stage_has_one_row_and_teachers_come_first() -> None:
    """STAGES covers Stage; a stage's teacher is an earlier stage of every type that trains it."""
    assert tuple(STAGES) == get_args(Stage)
    recipes = [replace(get_recipe("smoke"), hard_teacher=t) for t in ("soft", "dense")]
    for kind in REGISTRY.values():
        for i, stage in enumerate(kind.stages):
            teacher = STAGES[stage].teacher
            assert teacher is None or {teacher(r) for r in recipes} <= set(kind.stages[:i]), (kind.name, stage)
            assert (STAGES[stage].loss is None) == STAGES[stage].adaptive


def _model(seed: int = 0):  # type: ignore[no-untyped-def]
    model = random_init(LABELS, GateConfig(scope="model"), seed=seed)
    return model.eval()  # no dropout: losses are compared exactly


def _batch(n: int = 4, length: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 90, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[0, 8:] = 0  # one padded row: padding must not count in the hidden-state error
    return ids, mask, torch.tensor([0, 1, 2, 0])


def test_recipe_options_parse_and_bad_values_are_one_clear_error() -> None:
    assert parse_overrides(["hard_teacher=dense", "sandwich=true", "hidden_distill=1.5"]) == {
        "hard_teacher": "dense", "sandwich": True, "hidden_distill": 1.5}
    with pytest.raises(ValueError, match="hard_teacher must be one of soft, dense"):
        get_recipe("full", hard_teacher="teacher")
    with pytest.raises(ValueError, match="hidden_distill must be >= 0"):
        get_recipe("full", hidden_distill=-1.0)


def test_options_at_their_defaults_leave_a_run_identity_unchanged() -> None:
    plain = RunConfig(base="minilm", data="ag_news", recipe=get_recipe("full")).identity()
    assert not {"hard_teacher", "hidden_distill", "sandwich"} & set(plain["recipe"])
    changed = RunConfig(base="minilm", data="ag_news", recipe=get_recipe("full", sandwich=True)).identity()
    assert changed["recipe"]["sandwich"] is True


def test_logits_and_states_agree_with_forward() -> None:
    model = _model()
    ids, mask, _ = _batch()
    gate = model.hard_gates(0.5)
    logits, states = model.logits_and_states(ids, mask, gate)
    assert len(states) == model.cfg.n_layers and states[-1].shape == (4, 12, model.cfg.hidden_size)
    torch.testing.assert_close(logits, model(ids, mask, gate), rtol=0, atol=0)


def test_hidden_distillation_is_zero_for_the_teacher_itself_and_positive_otherwise() -> None:
    model, other = _model(0), _model(1)
    ids, mask, y = _batch()
    recipe = get_recipe("smoke", hard_teacher="dense")
    with_hidden = replace(recipe, hidden_distill=5.0)
    # b = 1 keeps every unit, so the student's forward pass is the dense teacher's: the hidden term is 0.
    same = _stage_loss(model, "hard", recipe, ids, mask, y, 1.0, teacher=model)
    assert _stage_loss(model, "hard", with_hidden, ids, mask, y, 1.0, teacher=model).item() == pytest.approx(
        same.item(), abs=1e-6)
    plain = _stage_loss(model, "hard", recipe, ids, mask, y, 1.0, teacher=other)
    assert _stage_loss(model, "hard", with_hidden, ids, mask, y, 1.0, teacher=other).item() > plain.item() + 1e-3


def test_the_sandwich_rule_averages_the_largest_smallest_and_sampled_budget() -> None:
    model = _model()
    ids, mask, y = _batch()
    recipe = get_recipe("smoke", b_min=0.1)
    single = [_stage_loss(model, "budget", recipe, ids, mask, y, b, None).item() for b in (1.0, 0.1, 0.4)]
    sandwich = _stage_loss(model, "budget", replace(recipe, sandwich=True), ids, mask, y, 0.4, None).item()
    assert sandwich == pytest.approx(sum(single) / 3, rel=1e-5)
    assert len({round(v, 6) for v in single}) == 3  # the three budgets do differ: the average is not trivial


def test_hard_stage_with_the_dense_teacher_trains_from_a_finished_stage_2(
    smoke_model_scope_checkpoint: Path, tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    (out / "stages").mkdir(parents=True)
    for stage in ("dense", "budget"):  # resume after stage 2 of the session's smoke run
        shutil.copytree(smoke_model_scope_checkpoint / "stages" / stage, out / "stages" / stage)
    proc = run_cli("train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", "--scope", "model",
                   "--set", "hard_teacher=dense", "--set", "sandwich=true", "--set", "hidden_distill=1",
                   "--out", str(out), "--device", "cpu")  # with the sweep, so the last stage is evaluated
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((out / "config.json").read_text())
    assert meta["recipe"]["hard_teacher"] == "dense" and meta["recipe"]["sandwich"] is True
    assert meta["stages"]["hard"]["steps"] > 0 and meta["stages"]["hard"]["best_val"] > 0.5


@pytest.mark.parametrize("stage,teacher_kind", [("budget", None), ("hard", "dense"), ("hard", "soft")])
def test_the_fused_sandwich_computes_the_same_loss_in_one_pass(stage: str, teacher_kind: str | None) -> None:
    model, other = _model(0), _model(1)
    ids, mask, y = _batch()
    mask[1, 7:] = 0  # a padded text: the repeated copies must keep their own masks
    recipe = get_recipe("smoke", sandwich=True, hidden_distill=0.5, hard_teacher=teacher_kind or "soft")
    teacher = other if teacher_kind else None
    three = _stage_loss(model, stage, recipe, ids, mask, y, 0.4, teacher)  # type: ignore[arg-type]
    fused = _stage_loss(model, stage, replace(recipe, fused_sandwich=True), ids, mask, y, 0.4, teacher)  # type: ignore[arg-type]
    assert fused.item() == pytest.approx(three.item(), rel=1e-5)
    # And the gradient reaches the gates the same way (straight-through in stage 3, soft in stage 2).
    g_three = torch.autograd.grad(three, model.gates.logit)[0]
    g_fused = torch.autograd.grad(
        _stage_loss(model, stage, replace(recipe, fused_sandwich=True), ids, mask, y, 0.4, teacher),  # type: ignore[arg-type]
        model.gates.logit)[0]
    torch.testing.assert_close(g_fused, g_three, rtol=1e-4, atol=1e-7)
    assert g_three.abs().sum() > 0


def test_a_smoke_run_with_exits_trains_its_exit_heads_and_stops_low_budgets_there(
    smoke_model_scope_checkpoint: Path, tmp_path: Path,
) -> None:
    out = tmp_path / "exits"
    (out / "stages").mkdir(parents=True)
    for stage in ("dense", "budget"):  # stages 1-2 take no exits: the session's run gives them
        shutil.copytree(smoke_model_scope_checkpoint / "stages" / stage, out / "stages" / stage)
    # One layer of the tiny base reads the task only if its word embeddings may move (smoke freezes them).
    proc = run_cli("train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", "--scope", "model",
                   "--exits", "1", "--set", "sandwich=true", "--set", "fused_sandwich=true",
                   "--set", "hard_teacher=dense", "--set", "freeze_embeddings=false", "--out", str(out),
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((out / "config.json").read_text())
    assert meta["model"]["gate"]["exits"] == [1] and meta["recipe"]["fused_sandwich"] is True
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["nested"] is True
    layers = {p["budget"]: p["layers_run"] for p in sweep["points"]}
    assert layers[0.1] == 1 and layers[1.0] == 2
    low = next(p for p in sweep["points"] if p["budget"] == 0.25)
    assert low["heads_per_layer"][1] == 0 and low["neurons_per_layer"][1] == 0
    # Stage 3 moved the exit head away from its start (a copy of the classifier), and the exit answers well.
    from headbudget.models.checkpoint import load_checkpoint

    model, _ = load_checkpoint(out)
    assert not torch.equal(model.exits[0].weight, model.classifier.weight)
    assert low["accuracy_hard"] > 0.7
    # `predict` says what the budget kept and where it stopped, and answers as the engine's plan would.
    pred = run_cli("predict", "--model", str(out), "--budget", "0.25", "a b c d")
    assert pred.returncode == 0, pred.stderr
    assert "stops after layer 1 of 2" in pred.stdout and "neurons: " in pred.stdout


@pytest.mark.parametrize("args,message", [
    (("--scope", "model", "--exits", "2"), "below n_layers"),
    (("--scope", "model", "--exits", "x"), "--exits"),
    (("--scope", "attention", "--exits", "1"), "whole-model scope"),
])
def test_bad_exits_are_one_line_errors(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    proc = run_cli("train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", *args,
                   "--out", str(tmp_path / "x"), "--device", "cpu")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def test_stages_copied_from_a_run_with_other_exits_train_this_runs_exits(tmp_path: Path) -> None:
    """Variants may share stages 1-2 by copying them; a run that resumes from another run's stage 2 must train
    its own exits, not the copied configuration's, and a copied stage 3 is refused."""
    src = tmp_path / "src"
    common = ("--base", "tiny", "--data", "synthetic", "--recipe", "smoke", "--scope", "model", "--device", "cpu",
              "--set", "dense_epochs=1", "--set", "budget_epochs=1", "--set", "hard_epochs=0.2", "--no-sweep")
    proc = run_cli("train", *common, "--exits", "1", "--out", str(src))
    assert proc.returncode == 0, proc.stderr[-2000:]
    dst = tmp_path / "dst"
    for stage in ("dense", "budget"):
        shutil.copytree(src / "stages" / stage, dst / "stages" / stage)
    proc = run_cli("train", *common, "--out", str(dst))  # no exits this time
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((dst / "config.json").read_text())["model"]["gate"]["exits"] == []
    bad = tmp_path / "bad"
    shutil.copytree(src / "stages", bad / "stages")  # stage 3 too: its exits are trained, not convertible
    proc = run_cli("train", *common, "--out", str(bad))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "gate settings" in proc.stderr.strip().splitlines()[-1]
