"""The bench command end to end on the tiny checkpoint (few repeats: behaviour, not timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.cli import main


def test_bench_writes_the_documented_fields(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_checkpoint), "--seq-len", "16", "--repeats", "2", "--no-memory",
                 "--precision", "fp32", "--out", str(out)]) == 0
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
    m = memory_figure(tiny_model_scope_checkpoint, dense, "fp32", probes=2)
    assert set(m) == {"engine_mb", "engine_sessions", "engine_unprepacked_mb", "dense_mb", "engine_over_dense",
                      "engine_unprepacked_over_dense", "samples_mb"}
    for key, values in m["samples_mb"].items():  # each figure: the median of its fresh processes
        assert len(values) == 2 and all(v > 0 for v in values) and m[f"{key}_mb"] == pytest.approx(sum(values) / 2)
    assert m["engine_over_dense"] == round(m["engine_mb"] / m["dense_mb"], 3)
    assert m["engine_unprepacked_over_dense"] == round(m["engine_unprepacked_mb"] / m["dense_mb"], 3)


def test_each_cache_setting_runs_what_it_says_before_each_timed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from headbudget.experiments import bench

    calls: list[tuple[str, int]] = []
    methods = {name: (lambda ids, mask, name=name: calls.append((name, int(ids[0, 0])))) for name in ("a", "b")}
    batches = [(np.full((1, 2), i, np.int64), np.ones((1, 2), np.int32)) for i in range(4)]
    monkeypatch.setattr(bench, "STEADY_BLOCK", 2)
    expected = {
        "cold": [(m, i) for i in range(4) for m in "ab"],
        "warm": [(m, i) for i in range(4) for m in "aabb"],
        # steady: per block of 2 texts, each method's untimed pass, then its timed pass over the same texts
        "steady": [(m, i) for blk in ((0, 1), (2, 3)) for m in "ab" for _ in range(2) for i in blk],
    }
    for cache in bench.CACHES:
        calls.clear()
        times = bench.time_round_robin(methods, batches, warmup=1, cache=cache)
        assert calls == expected[cache], cache
        assert {len(t) for t in times.values()} == {3}, cache  # one time per batch after the warm-up, paired


def test_warm_and_steady_time_the_second_call_on_each_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method whose first call on a text is slow (cold caches) is timed on its later call; cold times the first."""
    import numpy as np

    from headbudget.experiments import bench

    clock = [0.0]
    seen: set[int] = set()

    def slow_first(ids: np.ndarray, mask: np.ndarray) -> None:
        key = int(ids[0, 0])
        clock[0] += 0.001 if key in seen else 1.0
        seen.add(key)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    batches = [(np.full((1, 2), i, np.int64), np.ones((1, 2), np.int32)) for i in range(12)]
    for cache, want in (("warm", 0.001), ("steady", 0.001), ("cold", 1.0)):
        seen.clear()
        times = bench.time_round_robin({"m": slow_first}, batches, warmup=0, cache=cache)["m"]
        assert times == pytest.approx([want] * 12), cache


def test_bench_records_which_cache_it_timed(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from headbudget.experiments.bench import CACHES

    for flags, cache in ((["--cache", "steady"], "steady"), (["--warm-cache"], "warm")):
        out = tmp_path / f"bench-{cache}.json"
        assert main(["bench", "--model", str(tiny_checkpoint), "--seq-len", "16", "--repeats", "2", "--no-memory",
                     *flags, "--out", str(out)]) == 0
        r = json.loads(out.read_text())
        assert r["cache"] == cache and f"--cache {cache}" in r["command"] and "warm-cache" not in r["command"]
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(tiny_checkpoint), "--cache", "hot", "--out", str(tmp_path / "x.json")])
    from headbudget.cli import build_parser
    action = next(a for a in build_parser()._subparsers._group_actions[0].choices["bench"]._actions  # noqa: SLF001
                  if a.dest == "cache")
    assert tuple(action.choices) == CACHES  # the CLI offers exactly the settings the bench knows


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
