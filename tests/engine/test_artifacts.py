"""sweep.json and bench.json parse once into typed records; what is unusable is dropped, never fatal."""

from __future__ import annotations

from pathlib import Path

import pytest

from headbudget.engine.artifacts import BenchRecord, SweepRecord


def test_sweep_keeps_points_with_a_budget_and_a_hard_accuracy() -> None:
    doc = {"dense_accuracy": 0.91, "points": [{"budget": 0.25, "accuracy_hard": 0.8, "accuracy_soft": 0.82},
                                              {"budget": 1.0, "accuracy_hard": 0.9}, {"budget": 0.5},
                                              {"budget": True, "accuracy_hard": 0.7}, "x",
                                              {"budget": float("nan"), "accuracy_hard": 0.7}]}
    record = SweepRecord.parse(doc)
    assert record == SweepRecord(accuracy={0.25: 0.8, 1.0: 0.9}, dense_accuracy=0.91)
    assert record.budgets == [0.25, 1.0]


@pytest.mark.parametrize("doc", [None, [], {"rows": [1]}, {"points": "x"}, {"points": [{"budget": 0.5}]}])
def test_unusable_sweeps_are_none(doc: object) -> None:
    assert SweepRecord.parse(doc) is None


def test_bench_table_at_the_documents_or_the_rows_tokens() -> None:
    doc = {"seq_len": 128, "batch_size": 2, "rows": [
        {"budget": 0.5, "latency_ms": 4.0}, {"budget": 0.5, "latency_ms": 1.0, "seq_len": 32, "batch_size": 1},
        {"budget": 1.0, "latency_ms": 8.0}, {"budget": 1.0, "p50_ms": 7.0}, {"budget": 0.25, "latency_ms": -1}]}
    record = BenchRecord.parse(doc)
    assert record is not None and record.reference_tokens == 128.0
    assert record.table == {0.5: [(32.0, 1.0), (256.0, 4.0)], 1.0: [(256.0, 8.0)]}
    data = BenchRecord.parse({"seq_len": "data", "median_tokens": 43, "rows": [{"budget": 1.0, "latency_ms": 6.0}]})
    assert data is not None and data.reference_tokens == 43.0 and data.table == {1.0: [(43.0, 6.0)]}


@pytest.mark.parametrize("doc", [None, {"rows": "x"}, {"rows": [{"budget": "x"}, {"budget": 0.5}]}])
def test_unusable_benches_are_none(doc: object) -> None:
    assert BenchRecord.parse(doc) is None


def test_an_engine_without_bench_json_times_itself_at_warmup(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The service's latency table then comes from the engine that serves, in its own process."""
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions
    from headbudget.models.budget import BUDGET_GRID

    assert not (tiny_checkpoint / "bench.json").exists()
    engine = load_engine(tiny_checkpoint, EngineOptions(precision="int8", cache_dir=tmp_path, max_length=100))
    assert engine.info.bench is None
    engine.warmup()
    bench = engine.info.bench
    assert bench is not None and bench.reference_tokens == 64
    assert sorted(bench.table) == list(BUDGET_GRID)
    for points in bench.table.values():  # 128 tokens is past this engine's limit: its limit instead
        assert [t for t, _ in points] == [16.0, 64.0, 100.0] and all(ms > 0 for _, ms in points)
