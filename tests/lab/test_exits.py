"""Early-exit measurement: heads, costs, the engine running a plan cut to its first layers, bad input."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.plan import Shape


def _data(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = {"positive": ["good", "great", "fine", "happy"], "negative": ["bad", "awful", "sad", "poor"]}
    for name, n in (("train", 80), ("test", 30)):
        with (folder / f"{name}.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            for i in range(n):
                label = ("positive", "negative")[i % 2]
                w.writerow([" ".join(rng.choice(words[label], 5)) + " the movie", label])
    return folder


def test_fit_head_folds_the_standardization_and_separates() -> None:
    from lab.exits import fit_head

    rng = np.random.default_rng(1)
    y = np.arange(200) % 2
    x = rng.normal(size=(200, 8)) * 5.0 + 40.0
    x[:, 3] += np.where(y == 1, 30.0, -30.0)  # one separating direction, far from the origin and badly scaled
    w, b, wd = fit_head(x[:150], y[:150], x[150:], y[150:], 2)
    assert w.shape == (2, 8) and b.shape == (2,) and wd > 0
    assert ((x[150:] @ w.T + b).argmax(1) == y[150:]).all()


def test_cross_fitted_choice_respects_cost_and_scores_out_of_fold() -> None:
    from lab.exits import cross_fitted

    rng = np.random.default_rng(2)
    own = rng.random(400) < 0.6
    exit3 = rng.random(400) < 0.8
    correct = {"own@0.50": (0.499, own), "exit3@1.00": (0.45, exit3), "exit4@1.00": (0.667, np.ones(400, bool))}
    got = cross_fitted(correct, 0.5, exits=True)
    assert got["picks"] == ["exit3@1.00"] * 2  # the perfect plan costs too much
    assert got["accuracy"] == pytest.approx(exit3.mean())
    only = cross_fitted(correct, 0.5, exits=False)
    assert only["picks"] == ["own@0.50"] * 2 and only["accuracy"] == pytest.approx(own.mean())
    # A plan that looks best on one half is scored on the other half only: luck on the picking half does not count.
    half = np.zeros(400, bool)
    perm = np.random.default_rng(0).permutation(400)
    half[perm[:200]] = True  # right on exactly the first half's texts, wrong on the second
    got = cross_fitted({"own@0.50": (0.499, own), "exit2@1.00": (0.3, half)}, 0.5, exits=True)
    assert got["picks"][0] == "exit2@1.00" and got["accuracy"] < own.mean()


def test_exits_are_measured_against_the_checkpoints_own_curve(tiny_model_scope_checkpoint: Path,
                                                              tmp_path: Path) -> None:
    from lab.exits import exit_cost, exit_plan, measure

    data = _data(tmp_path / "data")
    doc = measure(tiny_model_scope_checkpoint, str(data), [0.5, 1.0], [0.5, 1.0], 4, 1)
    model, _ = load_checkpoint(tiny_model_scope_checkpoint)
    cfg, policy = model.cfg, model.gates.policy()
    assert [(r["depth"], r["width_budget"]) for r in doc["exits"]] == [
        (d, w) for d in range(1, cfg.n_layers) for w in (0.5, 1.0)]
    shape = Shape.of(cfg)
    for r in doc["exits"]:
        plan = policy.plan(r["width_budget"])
        assert r["cost"] == pytest.approx(exit_cost(plan, r["depth"], shape, cfg.gate.ref_length))
        # An exit runs a strict part of its width plan: cheaper than the plan, and the layers it runs.
        assert 0.0 < r["cost"] < plan.cost(shape, cfg.gate.ref_length).ratio
        assert exit_plan(plan, r["depth"]).heads == plan.heads[: r["depth"]]
        assert 0.0 <= r["accuracy"] <= 1.0 and r["latency_ms"] > 0
    assert [o["budget"] for o in doc["own"]] == [0.5, 1.0]
    for sched in doc["schedules"]:
        assert all(k.startswith("own@") for k in sched["own_only"]["picks"])
        assert 0.0 <= sched["with_exits"]["accuracy"] <= 1.0
    assert doc["n_test"] == 30


def test_a_checkpoint_with_exits_is_probed_below_its_first_exit_and_answers_with_its_own(
        tmp_path: Path) -> None:
    """Above a trained exit the checkpoint's plans stop there already; its own accuracy is what it serves."""
    from headbudget.models.tokenizer import TextEncoder
    from headbudget.training.batches import batches, order_for_eval, tokenize
    from headbudget.training.data import load_data
    from lab.exits import measure
    from tests.conftest import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path / "exits", seed=11, scope="model", ffn_group=32, exits=(2,), n_layers=4)
    data = _data(tmp_path / "data")
    budgets = [0.2, 0.5, 1.0]
    doc = measure(ckpt, str(data), [0.2, 0.5], budgets, 4, 1)
    assert sorted({r["depth"] for r in doc["exits"]}) == [1]  # the only layer below the exit at 2
    model, meta = load_checkpoint(ckpt)
    policy = model.gates.policy()
    assert policy.plan(0.2).depth == 2 and policy.plan(1.0).depth is None  # both answer paths are exercised
    test = tokenize(load_data(str(data), seed=7).split("test"), TextEncoder(ckpt, meta.get("max_length", 128)))
    model.eval()
    for own in doc["own"]:
        preds = []
        with torch.no_grad():
            for ids, mask, _ in batches(test, 128, torch.device("cpu")):
                preds.append(model.hard_logits(ids, mask, own["budget"]).argmax(1).numpy())
        order = np.empty(len(test.labels), np.int64)
        order[order_for_eval(test)] = np.concatenate(preds)
        assert own["accuracy"] == pytest.approx(float((order == test.labels).mean()))


def test_the_engine_runs_a_plan_cut_to_its_first_layers(tiny_model_scope_checkpoint: Path) -> None:
    """What the exit timings run: the engine's graph for the first d layers equals the reference's layer d."""
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions
    from lab.exits import exit_plan

    model, _ = load_checkpoint(tiny_model_scope_checkpoint)
    engine = load_engine(tiny_model_scope_checkpoint, EngineOptions(prepacked_budgets=()))
    ids = np.asarray([[101, 2204, 3185, 2003, 102, 0]], np.int64)
    mask = np.asarray([[1, 1, 1, 1, 1, 0]], np.int32)
    for b in (0.3, 1.0):
        plan = exit_plan(model.gates.policy().plan(b), 1)
        runner = engine._whole(plan, prepack=True)  # noqa: SLF001
        got = runner.run({"input_ids": runner.value(ids), "attention_mask": runner.value(mask)})
        with torch.no_grad():
            _, states = model.logits_and_states(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)),
                                                None if b >= 1 else model.hard_gates(b))
            ref = model.head(model.pool(states[0], torch.from_numpy(mask))).numpy()
        np.testing.assert_allclose(got, ref, atol=1e-4)


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lab.exits import main

    assert main(["--model", str(tmp_path / "none"), "--data", str(tmp_path), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
    assert main(["--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "o.json"),
                 "--widths", "0,1"]) == 2
    assert "(0, 1]" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "o.json"),
                 "--widths", "abc"]) == 2
    assert "comma-separated numbers" in capsys.readouterr().err
    # A folder that does not exist is refused before minutes of measuring, not with a traceback after them.
    assert main(["--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "nodir" / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "\n" not in err
    assert not (tmp_path / "o.json").exists()


def test_the_script_writes_its_document_with_the_command(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    import json

    from lab.exits import main

    data, out = _data(tmp_path / "data"), tmp_path / "exits.json"
    argv = ["--model", str(tiny_model_scope_checkpoint), "--data", str(data), "--out", str(out), "--widths", "1.0",
            "--budgets", "0.5,1.0", "--latency-texts", "3", "--latency-repeats", "1"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == "python -m lab.exits " + " ".join(argv)
    assert [(r["depth"], r["width_budget"]) for r in doc["exits"]] == [(1, 1.0)]  # the 2-layer model's one exit
    assert doc["latency"]["texts"] == 3
