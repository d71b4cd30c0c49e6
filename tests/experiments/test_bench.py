"""The bench command end to end on the tiny checkpoint (few repeats: behaviour, not timings)."""

from __future__ import annotations

import json
from pathlib import Path

from headbudget.cli import main


def test_bench_writes_the_documented_fields(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_checkpoint), "--seq-len", "16", "--repeats", "2", "--no-memory",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("seq_len", "batch_size", "threads", "precision", "cpu", "rows", "peers", "max_abs_logit_diff",
                "rss_mb", "overhead", "overhead_ms"):
        assert key in r
    assert [row["budget"] for row in r["rows"]] == [1.0, 0.75, 0.5, 0.25, 0.1]
    assert set(r["peers"]) == {"hf_eager_ms", "hf_sdpa_ms", "ort_fp32_ms", "ort_int8_ms"}
    assert r["max_abs_logit_diff"] < 1e-4
    assert r["rows"][0]["flop_bound_speedup"] == 1.0
    assert r["cache"] == "cold"
    for row in r["rows"]:  # each headline ratio with its bootstrap interval around it
        for key in ("speedup_vs_b1", "speedup_vs_ort_dense"):
            lo, hi = row[key + "_ci95"]
            assert 0 < lo <= hi


def test_bench_rejects_a_folder_as_out(tiny_checkpoint: Path, tmp_path: Path) -> None:
    assert main(["bench", "--model", str(tiny_checkpoint), "--out", str(tmp_path)]) == 2


def test_memory_figure_measures_the_engine_with_and_without_prepacked_budgets(
    tiny_model_scope_checkpoint: Path, tmp_path: Path,
) -> None:
    from headbudget.experiments import peers
    from headbudget.experiments.bench import memory_figure
    from headbudget.models.checkpoint import load_checkpoint

    model, _ = load_checkpoint(tiny_model_scope_checkpoint)
    dense, _ = peers.export_dense(model, tmp_path)
    m = memory_figure(tiny_model_scope_checkpoint, dense, "fp32")
    assert set(m) == {"engine_mb", "engine_sessions", "engine_unprepacked_mb", "dense_mb", "engine_over_dense",
                      "engine_unprepacked_over_dense"}
    assert m["engine_over_dense"] == round(m["engine_mb"] / m["dense_mb"], 3)
    assert m["engine_unprepacked_over_dense"] == round(m["engine_unprepacked_mb"] / m["dense_mb"], 3)


def test_warm_cache_times_each_call_right_after_an_untimed_call_of_the_same_method() -> None:
    import numpy as np

    from headbudget.experiments.bench import time_round_robin

    calls: list[str] = []
    methods = {name: (lambda ids, mask, name=name: calls.append(name)) for name in ("a", "b")}
    batches = [(np.zeros((1, 2), np.int64), np.ones((1, 2), np.int32))] * 4
    for warm, expected in ((False, ["a", "b"] * 4), (True, ["a", "a", "b", "b"] * 4)):
        calls.clear()
        times = time_round_robin(methods, batches, warmup=1, warm_cache=warm)
        assert calls == expected and {len(t) for t in times.values()} == {3}


def test_bench_records_which_cache_it_timed(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_checkpoint), "--seq-len", "16", "--repeats", "2", "--no-memory",
                 "--warm-cache", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["cache"] == "warm" and "--warm-cache True" in r["command"]


def test_ratio_interval_covers_the_ratio_and_narrows_with_more_rounds() -> None:
    import numpy as np

    from headbudget.experiments.bench import ratio_ci95

    rng = np.random.default_rng(3)
    widths = []
    for n in (30, 300):
        den = rng.lognormal(0.0, 0.3, n)  # per-round times of a method 4x faster, with per-text spread
        num = 4.0 * den * rng.lognormal(0.0, 0.05, n)
        lo, hi = ratio_ci95(num.tolist(), den.tolist())
        point = float(np.median(num) / np.median(den))
        assert lo <= point <= hi and lo < 4.0 < hi
        widths.append(hi - lo)
    assert widths[1] < 0.7 * widths[0]
    assert ratio_ci95([2.0] * 10, [1.0] * 10) == [2.0, 2.0]
