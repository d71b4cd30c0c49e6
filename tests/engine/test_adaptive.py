"""The adaptive fast path equals the reference models on padded batches, and its cost shows the savings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from headbudget.engine.adaptive.backend import AdaptiveEngine
from headbudget.engine.adaptive.cost import plan_macs, span_pairs
from headbudget.engine.adaptive.model_types import PATHS
from headbudget.engine.base import pad
from headbudget.engine.errors import BudgetError, ModelLoadError
from headbudget.engine.factory import load_engine, model_info
from headbudget.engine.reference.backend import TorchEngine
from headbudget.engine.types import EngineOptions
from headbudget.experiments.adaptive.bench import bench_lengths, main
from headbudget.models.adaptive import AdaptiveClassifier
from headbudget.models.budgetformer import budget_cap_heads
from headbudget.models.checkpoint import load_checkpoint, save_checkpoint
from headbudget.models.config import GateConfig, SpanConfig
from headbudget.models.model_types import adaptive_types
from headbudget.models.pretrained import minilm_path, random_init
from headbudget.models.span import SpanClassifier
from headbudget.models.tokenizer import copy_tokenizer

KINDS = ("budgetformer", "span", "adaattention")
SHAPE = dict(hidden_size=96, n_layers=2, n_heads=6, intermediate_size=192, max_position=128)
TEXTS = [  # 4, 21 and 60 tokens: one padded batch, long enough for span windows to bite
    "short one",
    "The striker scored twice in the final minutes of the match against the league leaders, and the crowd",
    "Scientists describe a distant planet whose atmosphere contains water vapour and clouds of iron, according "
    "to a study published on Tuesday in a journal of astronomy, with more findings expected. Scientists describe "
    "a distant planet whose atmosphere contains water vapour and clouds of iron, according to a study published "
    "on Tuesday.",
]
CAPS = (1.0, 0.75, 0.5, 0.25, 0.1)


def make_adaptive_checkpoint(folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny random model of ``kind`` whose adaptive choices are non-trivial, saved with tokenizer files."""
    extra = {"span": SpanConfig(ramp=8)} if kind == "span" else {}
    model = random_init(("a", "b", "c"), GateConfig(), seed=seed, model_type=kind, **SHAPE, **extra)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.encoder.parameters():  # larger than 0.02 so heads differ measurably
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for a in model.adaptive_layers():
            if kind == "budgetformer":  # s ~ 0.45 varying per input, p far from uniform
                a.relevance.weight.normal_(0, 1.0, generator=g)
                a.budget_hidden.weight.normal_(0, 0.3, generator=g)
                a.budget_out.weight.normal_(0, 0.3, generator=g)
                a.budget_out.bias.fill_(math.log(0.45 / 0.55))
            elif kind == "span":  # z = ratio * 128: windows 11, 15, 15, 28, 60, 137 (two share one)
                a.span_ratio.copy_(torch.tensor([0.02, 0.05, 0.05, 0.15, 0.4, 1.0]))
            else:  # some heads above the 0.5 threshold (full), some reduced, varying per input
                last = a.scorer[-1]
                last.weight.normal_(0, 0.5, generator=g)
                last.bias.copy_(torch.tensor([2.0, -1.0, 0.3, -2.5, 1.0, -0.3]))
    model.eval()
    save_checkpoint(model, folder, {"name": folder.name})
    copy_tokenizer(minilm_path(), folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adaptive")
    return {kind: make_adaptive_checkpoint(root / kind, kind) for kind in KINDS}


def _reference(folder: Path, engine: AdaptiveEngine, budget: float) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """Logits and usage of the reference model (eval forward, capped at ``budget``) on the padded batch of TEXTS."""
    model, _ = load_checkpoint(folder)
    assert isinstance(model, AdaptiveClassifier)
    ids, mask = pad(engine.encoder.encode(TEXTS).ids, engine.encoder.pad_id)
    with torch.no_grad():
        out = model.forward_adaptive(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), cap=budget)
    return out.logits.numpy(), out.usage


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-input"])
def test_logits_match_reference_on_padded_batch(checkpoints: dict[str, Path], kind: str, grouped: bool) -> None:
    engine = load_engine(checkpoints[kind], EngineOptions(backend="torch"))
    assert isinstance(engine, AdaptiveEngine)
    engine.grouped = grouped
    for b in CAPS if kind == "budgetformer" else (1.0, 0.3):
        ref, _ = _reference(checkpoints[kind], engine, b)
        got = np.array([p.logits for p in engine.predict(TEXTS, b).predictions])
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=f"{kind} budget {b}")
        ids, mask = pad(engine.encoder.encode(TEXTS).ids, engine.encoder.pad_id)
        np.testing.assert_allclose(engine.predict_ids(ids, mask, b), ref, atol=1e-4, rtol=0)


def test_budgetformer_heads_follow_the_model_and_the_cap(checkpoints: dict[str, Path]) -> None:
    engine = load_engine(checkpoints["budgetformer"], EngineOptions(backend="torch"))
    total = engine.info.n_layers * engine.info.n_heads
    previous: list[int] | None = None
    for b in CAPS:
        result = engine.predict(TEXTS, b)
        _, usage = _reference(checkpoints["budgetformer"], engine, b)  # type: ignore[arg-type]
        heads = usage["heads"].sum(1).tolist()  # (B,) heads each input ran, over layers
        assert [p.cost.heads_active for p in result.predictions] == heads
        assert [p.budget_chosen for p in result.predictions] == pytest.approx([h / total for h in heads])
        assert result.heads_active == round(sum(heads) / len(heads)) and result.heads_total == total
        assert engine.plan(b).heads == (budget_cap_heads(b, engine.info.n_heads),) * engine.cfg.n_layers
        assert max(usage["heads"].max().item(), 1) <= budget_cap_heads(b, engine.info.n_heads)
        if previous is not None:
            assert all(h <= p for h, p in zip(heads, previous, strict=True))
        previous = heads
    uncapped = [p.cost.heads_active for p in engine.predict(TEXTS, 1.0).predictions]
    assert len(set(uncapped)) > 1 or max(uncapped) < total  # the model's own choice is not "every head"
    assert sum(previous or []) < sum(uncapped)  # a lower cap gives fewer heads


def test_span_cost_counts_the_windows(checkpoints: dict[str, Path]) -> None:
    engine = load_engine(checkpoints["span"], EngineOptions(backend="torch"))
    model, _ = load_checkpoint(checkpoints["span"])
    assert isinstance(model, SpanClassifier)
    windows = model.windows()  # per layer, per head (the reference's own inference windows)
    d, result = engine.info.extra["hidden_size"], engine.predict(TEXTS, 0.5)
    for p in result.predictions:
        n = p.n_tokens
        pairs = [[span_pairs(w, n) for w in layer] for layer in windows]
        expected = sum(plan_macs(d, n, [engine.cfg.head_dim] * len(row), row) for row in pairs)
        assert p.cost.attention_macs == expected
        assert p.budget_chosen is None  # spans are learned, not a budget each input chooses
        assert p.cost.heads_active == p.cost.heads_total == 12
    long = result.predictions[2]
    assert long.n_tokens == 60 and long.cost.attention_macs < long.cost.attention_macs_dense
    assert long.cost.total_macs < long.cost.total_macs_dense and long.cost.attention_ratio < 1.0
    assert result.predictions[0].cost.attention_ratio == 1.0  # 4 tokens: every window covers the input
    assert {engine.plan(b).key for b in (0.1, 0.5, 1.0)} == {(engine.cfg.n_heads,) * engine.cfg.n_layers}  # one batch


def test_adaattention_cost_counts_the_reduced_dims(checkpoints: dict[str, Path]) -> None:
    engine = load_engine(checkpoints["adaattention"], EngineOptions(backend="torch"))
    result = engine.predict(TEXTS, 1.0)
    _, usage = _reference(checkpoints["adaattention"], engine, 1.0)  # type: ignore[arg-type]
    dims = usage["dims"]  # (B, L, H)
    assert (dims == engine.cfg.head_dim).any() and (dims < engine.cfg.head_dim).any()
    d = engine.cfg.hidden_size
    for i, p in enumerate(result.predictions):
        n = p.n_tokens
        expected = sum(plan_macs(d, n, row, [n * n] * len(row)) for row in dims[i].tolist())
        assert p.cost.attention_macs == expected < p.cost.attention_macs_dense
        assert p.budget_chosen is None and p.cost.attention_ratio < 1.0
        assert p.cost.total_macs > p.cost.attention_macs  # FFN, classifier and the scorer on top
    assert engine.plan(0.2).key == engine.plan(1.0).key  # the budget is not used: every request shares a batch


@pytest.mark.parametrize("kind", ["span", "adaattention"])
def test_dense_baseline_computes_everything(checkpoints: dict[str, Path], kind: str) -> None:
    engine = load_engine(checkpoints[kind], EngineOptions(backend="torch"))
    assert isinstance(engine, AdaptiveEngine)
    rows = [np.asarray(r, dtype=np.int64) for r in engine.encoder.encode(TEXTS).ids]
    dense, usages = engine.run_rows(rows, engine.n_heads, adaptive=False)
    for u, n in zip(usages, (len(r) for r in rows), strict=True):
        h, dh = engine.n_heads, engine.head_dim
        assert sum(u.attention) == engine.cfg.n_layers * plan_macs(engine.cfg.hidden_size, n, [dh] * h, [n * n] * h)
    if kind == "span":  # dense span is still the span model (the ramp applies): equal to the reference
        ref, _ = _reference(checkpoints[kind], engine, 1.0)
        np.testing.assert_allclose(dense.numpy(), ref, atol=1e-4, rtol=0)


def test_model_info_and_options(checkpoints: dict[str, Path], tiny_checkpoint: Path) -> None:
    for kind in KINDS:
        info = model_info(checkpoints[kind], EngineOptions())
        assert info.model_type == kind and info.supports_auto == (kind == "budgetformer")
        with pytest.raises(ModelLoadError, match="int8"):
            load_engine(checkpoints[kind], EngineOptions(precision="int8"))
        with pytest.raises(ModelLoadError, match="int8"):
            load_engine(checkpoints[kind], EngineOptions(backend="torch", precision="int8"))
    # fp32 onnxruntime is served by the adaptive path (logged), not refused
    assert isinstance(load_engine(checkpoints["span"], EngineOptions()), AdaptiveEngine)
    with pytest.raises(BudgetError):
        load_engine(checkpoints["span"], EngineOptions(backend="torch")).predict(["text"], 1.5)


def test_budgeted_type_is_unaffected(tiny_checkpoint: Path) -> None:
    info = model_info(tiny_checkpoint, EngineOptions(backend="torch"))
    assert info.model_type == "budgeted" and not info.supports_auto and info.extra["backend"] == "torch"
    engine = load_engine(tiny_checkpoint, EngineOptions(backend="torch"))
    assert isinstance(engine, TorchEngine)
    result = engine.predict(TEXTS, 0.5)
    assert all(p.budget_chosen is None for p in result.predictions)
    assert result.heads_active == engine.plan(0.5).heads_active


def test_bench_lengths_and_cli(checkpoints: dict[str, Path], tiny_checkpoint: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    r = bench_lengths(checkpoints["span"], (16, 96), repeats=2, warmup=1)
    assert set(r["lengths"]) == {"16", "96"}
    row = r["lengths"]["96"]
    for key in ("adaptive_ms", "fast_dense_ms", "reference_ms", "speedup_vs_fast_dense", "speedup_vs_reference"):
        assert row[key] > 0
    assert row["attention_mac_ratio"] < 1.0 and row["max_abs_logit_diff"] < 1e-4
    (tmp_path / "test.csv").write_text("text,label\nA few words of real text,a\nAnd another one here,b\n")
    assert bench_lengths(checkpoints["budgetformer"], (40,), 1, 0, tmp_path)["inputs"] == "data"
    assert main(["--model", str(checkpoints["adaattention"]), "--lengths", "24", "--repeats", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["model_type"] == "adaattention"
    for argv in (["--model", str(tmp_path / "missing")], ["--model", str(tiny_checkpoint)],
                 ["--model", str(checkpoints["span"]), "--lengths", "512"]):
        assert main([*argv, "--repeats", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1


def test_bench_texts_times_real_texts_against_other_engines(checkpoints: dict[str, Path], tiny_checkpoint: Path,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = "\n".join(f"text number {i} with {'some ' * (i % 7)}words,a" for i in range(12))
    (tmp_path / "test.csv").write_text("text,label\n" + rows + "\n")
    argv = ["--model", str(checkpoints["budgetformer"]), "--data", str(tmp_path), "--texts", "6", "--warmup", "1",
            "--compare", f"budgeted_half={tiny_checkpoint}@0.5", "--compare", f"half_torch={tiny_checkpoint}@0.5:torch"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["texts"] == 6 and r["others"][0]["budget"] == 0.5
    assert [o["backend"] for o in r["others"]] == ["onnxruntime", "torch"]
    assert r["adaptive_ms"] > 0 and r["fast_dense_ms"] > 0 and r["budgeted_half_ms"] > 0 and r["half_torch_ms"] > 0
    assert 0 < r["attention_mac_ratio"] <= 1.0
    assert main(["--model", str(checkpoints["budgetformer"]), "--texts", "3"]) == 2
    assert main([*argv[:6], "--compare", "nonsense"]) == 2
    assert main([*argv[:6], "--compare", f"x={tiny_checkpoint}@0.5:gpu"]) == 2
    assert capsys.readouterr().err.count("error: ") == 3


def test_adjacent_dense_with_ramp_groups_run_as_one() -> None:
    from headbudget.engine.adaptive.backend import RAMP_DENSE, _merge_ramp_groups

    plan = (((0,), 32, 11), ((1, 2), 32, 15), ((3,), 32, 28), ((4,), 32, 60), ((5,), 32, 137))
    # n = 60: windows 11 and 15 run banded, 28 / 60 / 137 all run over every key with the ramp
    assert _merge_ramp_groups(plan, 60) == (((0,), 32, 11), ((1, 2), 32, 15), ((3, 4, 5), 32, RAMP_DENSE))
    assert _merge_ramp_groups(plan, 8) == (((0, 1, 2, 3, 4, 5), 32, RAMP_DENSE),)
    assert _merge_ramp_groups((((0, 1), 32, 0),), 60) == (((0, 1), 32, 0),)  # not a span model: untouched


def test_every_adaptive_type_has_a_fast_path() -> None:
    assert set(PATHS) == set(adaptive_types()) == set(KINDS)
