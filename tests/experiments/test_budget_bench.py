"""`headbudget bench --all-budgets` end to end on the tiny checkpoint (few repeats: behaviour, not timings), its
checks on made-up rows, and the pareto plot drawing its file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from headbudget.cli import main
from headbudget.experiments.budget_bench import OFF_GRID_BUDGETS, budget_checks
from headbudget.models.budget import BUDGET_GRID

FIELDS = ("precision", "seq_len", "median_tokens", "repeats", "threads", "cache", "cpu", "date", "commit", "command",
          "model", "rows", "peers", "checks", "floor")
ROW_FIELDS = {"budget", "latency_ms", "p90_ms", "share_of_b1", "share_of_b1_ci95", "mac_fraction", "heads_active",
              "layers_run", "share_of_ort_dense"}


@pytest.fixture(scope="module")
def budgets_file(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("budgets") / "fp32-budgets.json"
    assert main(["bench", "--all-budgets", "--model", str(tiny_checkpoint), "--seq-len", "16", "--repeats", "2",
                 "--precision", "fp32", "--memory-probes", "1", "--out", str(out)]) == 0
    return out


def test_all_budgets_writes_every_budget_with_its_fields(budgets_file: Path) -> None:
    from headbudget.commands.bench import _budgets_table

    r = json.loads(budgets_file.read_text())
    for key in FIELDS:
        assert key in r, key
    assert (r["precision"], r["seq_len"], r["median_tokens"], r["repeats"], r["threads"], r["cache"]) == \
        ("fp32", 16, 16, 2, 1, "cold")
    assert r["command"].startswith("headbudget bench ") and "--all-budgets" in r["command"]
    assert set(r["peers"]) == {"ort_fp32_ms"}
    budgets = [row["budget"] for row in r["rows"]]
    assert budgets == sorted({*BUDGET_GRID, *OFF_GRID_BUDGETS})  # every grid and off-grid budget, once
    for row in r["rows"]:
        assert set(row) == ROW_FIELDS
        lo, hi = row["share_of_b1_ci95"]
        assert 0 < lo <= hi and row["share_of_ort_dense"] > 0 and row["latency_ms"] <= row["p90_ms"]
    fractions = [row["mac_fraction"] for row in r["rows"]]
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]  # more budget never runs fewer MACs
    top = r["rows"][-1]
    assert top["budget"] == 1.0 and top["mac_fraction"] == 1.0 and top["share_of_b1"] == 1.0
    assert top["share_of_b1_ci95"] == [1.0, 1.0] and top["heads_active"] == 8 and top["layers_run"] == 2
    assert [c["budget"] for c in r["checks"]["rows"]] == budgets
    assert r["checks"] == budget_checks(r["rows"])  # the block is what the rows say
    mem = r["memory"]  # every budget as served against one dense session, each measured in a process of its own
    assert all(len(values) == 1 for values in mem["samples_mb"].values())  # --memory-probes 1
    assert mem["engine_mb"] > 0 and mem["dense_mb"] > 0 and mem["engine_over_dense"] == round(mem["engine_mb"] / mem["dense_mb"], 3)
    floor = r["floor"]  # one head a layer (attention scope: every neuron)
    assert floor["heads_per_layer"] == [1, 1] and floor["neurons_per_layer"] is None
    assert 0 < floor["mac_fraction"] < 1 and floor["latency_ms"] > 0 and floor["share_of_b1"] > 0
    table = _budgets_table(r).splitlines()
    assert len(table) == 2 + len(budgets) + 3 and table[-1].startswith("checks: ") and table[-3].startswith("peers: ")


def test_the_checks_flag_a_budget_over_the_rule_and_one_slower_than_a_larger_budget() -> None:
    def row(budget: float, ms: float) -> dict[str, Any]:
        return {"budget": budget, "latency_ms": ms, "share_of_b1": ms / 10.0}

    good = [row(0.25, 3.0), row(0.5, 5.0), row(0.75, 7.5), row(1.0, 10.0)]
    c = budget_checks(good)
    assert c["all_within_rule"] and c["all_monotone"] and c["failing_budgets"] == []
    # 0.25 at 4.5 ms takes 45% of b = 1 (> 0.25 + 0.15); 0.5 at 6.4 ms is over 3% slower than 0.75's 6 ms
    bad = budget_checks([row(1.0, 10.0), row(0.5, 6.4), row(0.25, 4.5), row(0.75, 6.0)])
    flags = {r["budget"]: (r["within_rule"], r["monotone"]) for r in bad["rows"]}
    assert flags == {0.25: (False, True), 0.5: (True, False), 0.75: (True, True), 1.0: (True, True)}
    assert not bad["all_within_rule"] and not bad["all_monotone"] and bad["failing_budgets"] == [0.25, 0.5]
    # within 3% of a larger budget is still monotone
    edge = budget_checks([row(0.25, 3.9), row(0.5, 6.4), row(0.75, 6.3), row(1.0, 10.0)])
    assert edge["all_within_rule"] and edge["all_monotone"]


def test_all_budgets_at_real_text_lengths(tiny_checkpoint: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    texts = ["short one", "a somewhat longer text about markets and oil prices today", "mid length text here"]
    (data / "test.csv").write_text("text,label\n" + "".join(f"{t},0\n" for t in texts))
    out = tmp_path / "data-budgets.json"
    assert main(["bench", "--all-budgets", "--model", str(tiny_checkpoint), "--data", str(data), "--repeats", "2",
                 "--precision", "int8", "--off-grid-budgets", "0.33", "--no-memory", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["seq_len"] == "data" and isinstance(r["median_tokens"], int) and set(r["peers"]) == {"ort_int8_ms"}
    assert "memory" not in r
    assert [row["budget"] for row in r["rows"]] == sorted({*BUDGET_GRID, 0.33})
    assert r["rows"][-1]["mac_fraction"] == 1.0 and r["rows"][-1]["share_of_b1"] == 1.0


@pytest.mark.parametrize("bad", ["1.5", "0", "0.05", "-0.2", "nan", "half"])
def test_a_bad_off_grid_budget_is_one_line_and_a_non_zero_exit(
    bad: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--all-budgets", "--model", str(tiny_checkpoint), "--off-grid-budgets", "0.37", bad,
              "--out", str(tmp_path / "b.json")])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("headbudget bench: error: argument --off-grid-budgets: budget must be a number in [0.1, 1]")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "b.json").exists()


def test_off_grid_budgets_need_the_all_budgets_mode(tiny_checkpoint: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", str(tiny_checkpoint), "--off-grid-budgets", "0.37",
                 "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--all-budgets" in err


def _sweep() -> dict[str, Any]:
    points = [{"budget": b, "soft_cost": b, "hard_cost": b, "accuracy_soft": 0.5 + b / 3, "accuracy_hard": 0.5 + b / 3}
              for b in BUDGET_GRID]
    return {"points": points, "dense_accuracy": 0.85, "split": "test", "dataset": "tiny", "n_examples": 10}


def test_pareto_draws_the_budgets_file_in_place_of_its_bench_json(budgets_file: Path, tmp_path: Path) -> None:
    from headbudget.experiments.plots import latency_tables, load_benches, pareto_plot

    folder = tmp_path / "model"
    folder.mkdir()
    old = {"precision": "fp32", "seq_len": 16, "rows": [{"budget": 0.5, "latency_ms": 1.0}],
           "peers": {"ort_fp32_ms": 2.0}}
    other = {**old, "precision": "int8"}
    (folder / "bench.json").write_text(json.dumps(old))
    (folder / "bench-int8.json").write_text(json.dumps(other))
    assert latency_tables(load_benches(folder)) == [other, old]  # no budgets file: the bench files as before
    pareto_plot(_sweep(), tmp_path / "old.png", benches=load_benches(folder))
    (folder / "fp32-budgets.json").write_text(budgets_file.read_text())
    docs = load_benches(folder)
    assert len(docs) == 3
    drawn = latency_tables(docs)
    assert [d["precision"] for d in drawn] == ["int8", "fp32"] and drawn[1]["mode"] == "all-budgets"
    assert pareto_plot(_sweep(), tmp_path / "pareto.png", benches=docs).stat().st_size > 0
