"""lab/standin.py: a checkpoint's plans rebuilt from its sweep alone, checked at every swept budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.budget import BUDGET_GRID
from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.plan import Shape
from lab import standin
from tests.conftest import make_random_checkpoint, run_cli
from tests.lab.sweeps import plan_sweep


@pytest.fixture(scope="module")
def exits_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random whole-model checkpoint of the tiny base with an exit after layer 1 of 2."""
    return make_random_checkpoint(tmp_path_factory.mktemp("standin") / "exits", seed=11, scope="model",
                                  ffn_group=32, exits=(1,))


@pytest.fixture(scope="module")
def with_exits(exits_folder: Path) -> BudgetedClassifier:
    return load_checkpoint(exits_folder)[0]


@pytest.mark.parametrize("kind", ["attention", "model", "model-exits"])
def test_the_standin_runs_every_plan_of_the_checkpoint(kind: str, tiny_checkpoint: Path,
                                                       tiny_model_scope_checkpoint: Path,
                                                       with_exits: BudgetedClassifier) -> None:
    original = {"attention": lambda: load_checkpoint(tiny_checkpoint)[0],
                "model": lambda: load_checkpoint(tiny_model_scope_checkpoint)[0],
                "model-exits": lambda: with_exits}[kind]()
    model = standin.build(plan_sweep(original), "tiny", None)
    assert (model.gates.order() == original.gates.order()).all()  # the whole ranking, not only the counts
    new, old = model.gates.policy(), original.gates.policy()
    assert [new.plan(b) for b in BUDGET_GRID] == [old.plan(b) for b in BUDGET_GRID]
    assert (new.perms == old.perms).all() and (new.ffn_perms == old.ffn_perms).all()
    if kind == "model-exits":  # the grid reaches both depths, or the exit case would test nothing
        assert {new.plan(b).depth for b in BUDGET_GRID} == {1, None}


def test_a_sweep_that_does_not_match_is_refused(with_exits: BudgetedClassifier) -> None:
    sweep = plan_sweep(with_exits, record_exits=False)  # as sweeps written before they recorded exits
    with pytest.raises(ValueError, match="--exits"):
        standin.build(sweep, "tiny", None)
    assert standin.build(sweep, "tiny", (1,)).gates.policy().plan(0.1) == with_exits.gates.policy().plan(0.1)
    with pytest.raises(ValueError, match="differs from the sweep's exits"):
        standin.build(plan_sweep(with_exits), "tiny", (2,))
    bad = {**plan_sweep(with_exits), "head_order": plan_sweep(with_exits)["head_order"][:-1]}
    with pytest.raises(ValueError, match="not a ranking"):
        standin.build(bad, "tiny", None)


def test_the_cli_writes_a_checkpoint_the_engine_runs_and_serve_refuses(with_exits: BudgetedClassifier,
                                                                       tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(plan_sweep(with_exits)))
    out = tmp_path / "standin"
    assert standin.main(["--sweep", str(sweep), "--base", "tiny", "--out", str(out)]) == 0
    assert not (out / "sweep.json").exists()  # nothing beside it claims the checkpoint's accuracy
    engine = load_engine(out, EngineOptions(cache_dir=tmp_path / "cache"))
    try:
        policy = with_exits.gates.policy()
        assert [engine.plan(b) for b in BUDGET_GRID] == [policy.plan(b) for b in BUDGET_GRID]
        answer = engine.predict(["a short text"], 0.1).predictions[0]  # what it ran, as the checkpoint would
        assert answer.cost == policy.plan(0.1).cost(Shape.of(with_exits.cfg), answer.n_tokens)
    finally:
        engine.close()
    served = run_cli("serve", "--model", str(out), "--port", "1", timeout=60)
    assert served.returncode == 2 and "timing stand-in" in served.stderr and "--allow-standin" in served.stderr
    assert len(served.stderr.strip().splitlines()) == 1
    answered = run_cli("predict", "--model", str(out), "--budget", "0.5", "a text", timeout=60)
    assert answered.returncode == 2 and "timing stand-in" in answered.stderr and not answered.stdout


def test_bad_input_is_one_line(with_exits: BudgetedClassifier, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    sweep, other = tmp_path / "sweep.json", tmp_path / "other.json"
    sweep.write_text(json.dumps(plan_sweep(with_exits)))
    precious = tmp_path / "precious"  # an existing folder that is not a stand-in is never replaced
    precious.mkdir()
    (precious / "keep").write_text("x")
    bad = [["--sweep", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")],
           ["--sweep", str(sweep), "--exits", "a", "--out", str(tmp_path / "x")],
           ["--sweep", str(sweep), "--base", "tiny", "--out", str(precious)],
           ["--sweep", str(other), "--out", str(tmp_path / "x")]]
    for content in ("[]", "{}", "not json"):
        other.write_text(content)
        assert standin.main(bad[-1]) == 2
    for args in bad[:-1]:
        assert standin.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 6 and all(line.startswith("error: ") for line in err)
    assert "not a sweep.json" in err[0] and "not valid JSON" in err[2] and "not a stand-in" in err[5]
    assert (precious / "keep").read_text() == "x"
    assert standin.main(["--sweep", str(sweep), "--base", "tiny", "--out", str(tmp_path / "s")]) == 0
    assert standin.main(["--sweep", str(sweep), "--base", "tiny", "--out", str(tmp_path / "s")]) == 0  # replaced


def test_the_standin_is_timed_against_its_checkpoint_in_one_process(with_exits: BudgetedClassifier,
                                                                   exits_folder: Path, tmp_path: Path) -> None:
    sweep, report = tmp_path / "sweep.json", tmp_path / "check.json"
    sweep.write_text(json.dumps(plan_sweep(with_exits)))
    args = ["--sweep", str(sweep), "--base", "tiny", "--out", str(tmp_path / "s"), "--time-against",
            str(exits_folder), "--report", str(report), "--latency-texts", "3", "--latency-repeats", "1"]
    assert standin.main(args) == 0
    doc = json.loads(report.read_text())
    assert [r["budget"] for r in doc["rows"]] == list(standin.CHECK_BUDGETS)
    for r in doc["rows"]:
        assert r["standin_over_checkpoint"] == pytest.approx(r["standin_ms"] / r["checkpoint_ms"])
    assert doc["command"] == "python -m lab.standin " + " ".join(args)
    assert standin.main(args[:6] + ["--time-against", str(exits_folder)]) == 2  # no --report to write to
