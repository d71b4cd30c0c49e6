"""A batch in passes under EngineOptions.max_activation_bytes (engine/passes.py): how texts are grouped, that fp32
answers do not change with the grouping, what int8 answers depend on, the cap's floor, and that the memory of a
large batch is given back."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from headbudget.engine import passes
from headbudget.engine.base import EngineBase
from headbudget.engine.errors import ModelLoadError
from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.loadtest.memory import Sampler, rss_mb
from headbudget.models.plan import ExecutionPlan, Shape

MINILM = Shape(hidden=384, n_heads=12, head_dim=32, intermediate=1536, n_labels=4)
DENSE = ExecutionPlan(heads=(12,) * 6, n_heads=12)


def texts_of(n: int, seed: int = 0) -> list[str]:
    """``n`` texts of 2 to ~150 words (the tiny checkpoint cuts at 128 tokens)."""
    rng = random.Random(seed)
    words = "the market rose as oil fell while a team won the cup and leaders met to talk".split()
    return [" ".join(rng.choice(words) for _ in range(rng.choice([2, 5, 12, 30, 70, 150]))) for _ in range(n)]


def counting(engine: Any) -> list[tuple[int, int]]:
    """Record the (texts, padded length) of every forward pass ``engine`` runs from now on."""
    shapes: list[tuple[int, int]] = []
    forward = engine.forward_ids

    def wrapped(ids: np.ndarray, mask: np.ndarray, plan: ExecutionPlan) -> np.ndarray:
        shapes.append(ids.shape)
        return forward(ids, mask, plan)  # type: ignore[no-any-return]

    engine.forward_ids = wrapped
    return shapes


# -- grouping ------------------------------------------------------------------------------------------------
def test_a_batch_that_is_one_pass_runs_in_its_order() -> None:
    assert passes.split([5, 1, 3], lambda b, n: True, pad_share=None) == [[0, 1, 2]]
    assert passes.split([40, 38, 41, 40], lambda b, n: True) == [[0, 1, 2, 3]]  # padding within the share
    assert passes.split([], lambda b, n: True) == []


def test_passes_go_by_length_and_pad_at_most_their_share() -> None:
    """A pass pads to its longest text: texts of a real length mix go by length, and the padding of each pass stays
    within PAD_SHARE of its texts' own tokens (padded to the longest, these 32 ran 2.4x their own tokens)."""
    rng = random.Random(3)
    lengths = [rng.choice([12, 20, 31, 40, 44, 47, 52, 60, 75, 128, 165]) + rng.randrange(4) for _ in range(32)]
    groups = passes.split(lengths, lambda b, n: True)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [lengths[i] for g in groups for i in g] == sorted(lengths)
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= (1 + passes.PAD_SHARE) * sum(lengths[i] for i in g)
    run = passes.padded_tokens(lengths, groups)
    assert run <= (1 + passes.PAD_SHARE) * sum(lengths) < passes.padded_tokens(lengths, [list(range(32))]) / 1.5
    assert len(groups) < len(lengths)  # texts of one length still share a pass


def test_passes_go_by_length_and_each_fits() -> None:
    lengths = [50, 3, 20, 128, 7, 90, 3, 128, 64]

    def fits(b: int, n: int) -> bool:
        return b * n * n <= 20_000

    groups = passes.split(lengths, fits, pad_share=None)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(fits(len(g), max(lengths[i] for i in g)) for g in groups)
    order = [lengths[i] for g in groups for i in g]
    assert order == sorted(lengths)  # shortest first: a pass pads to its own longest text
    assert len(groups) > 1
    # Each pass is as full as it fits: adding the next text would not have.
    for g, nxt in zip(groups, groups[1:], strict=False):
        assert not fits(len(g) + 1, lengths[nxt[0]])


def test_a_text_that_alone_does_not_fit_runs_alone() -> None:
    assert passes.split([10, 500, 12], lambda b, n: n < 100 and b <= 2) == [[0, 2], [1]]


def test_scores_make_the_estimate_grow_with_the_square_of_the_length() -> None:
    one = passes.activation_bytes(MINILM, DENSE, 1, 512)
    assert passes.activation_bytes(MINILM, DENSE, 8, 512) > 7.5 * one
    assert passes.activation_bytes(MINILM, DENSE, 1, 1024) > 3.5 * one
    fewer = ExecutionPlan(heads=(6,) * 6, n_heads=12, ffn=(768,) * 6)
    assert passes.activation_bytes(MINILM, fewer, 1, 512) < 0.6 * one
    # MiniLM, 512 tokens, every head: about 2 copies of 12 x 512 x 512 fp32 scores (25 MiB) per text.
    assert 25 * passes.MiB < one < 32 * passes.MiB


# -- answers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0.25, 0.5, 1.0])
def test_fp32_logits_do_not_change_when_a_batch_is_split(tiny_model_scope_checkpoint: Path, tmp_path: Path,
                                                         budget: float) -> None:
    texts = texts_of(24)
    whole = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision="fp32", cache_dir=tmp_path))
    reference = whole.predict(texts, budget)
    assert isinstance(whole, EngineBase)
    one_text = passes.activation_bytes(whole.shape, whole.plan(1.0), 1, whole.max_length)
    for times in (1, 2, 5):
        split = load_engine(tiny_model_scope_checkpoint,
                            EngineOptions(precision="fp32", cache_dir=tmp_path, max_activation_bytes=times * one_text))
        assert isinstance(split, EngineBase)
        shapes = counting(split)
        result = split.predict(texts, budget)
        assert len(shapes) > 1, "the cap should have split the batch"
        assert all(passes.activation_bytes(split.shape, split.plan(budget), b, n) <= times * one_text
                   for b, n in shapes)
        for p, q in zip(reference.predictions, result.predictions, strict=True):
            assert p.logits == q.logits and p.label == q.label and p.cost == q.cost and p.n_tokens == q.n_tokens


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_mixed_batch_runs_about_its_own_tokens(tiny_model_scope_checkpoint: Path, tmp_path: Path,
                                                 precision: str) -> None:
    """What the engine runs for a batch of texts of many lengths: passes by length, whose tokens (padding
    included, as the result reports them) stay within PAD_SHARE of the texts' own."""
    texts = texts_of(32, seed=2)
    engine = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision=precision, cache_dir=tmp_path))
    shapes = counting(engine)
    result = engine.predict(texts, 0.5)
    own = sum(p.n_tokens for p in result.predictions)
    assert result.tokens_run == sum(b * n for b, n in shapes)
    assert own <= result.tokens_run <= (1 + passes.PAD_SHARE) * own
    assert 1 < len(shapes) < len(texts)
    longest = max(p.n_tokens for p in result.predictions)
    assert result.tokens_run < len(texts) * longest / 2  # what one pass padded to the longest text ran
    if precision == "fp32":  # and the answers are the texts' own
        for text, p in zip(texts, result.predictions, strict=True):
            assert engine.predict([text], 0.5).predictions[0].logits == pytest.approx(p.logits, abs=1e-5)


@pytest.mark.parametrize("budget", [0.25, 1.0])
def test_int8_split_answers_are_those_of_its_passes_run_alone(tiny_model_scope_checkpoint: Path, tmp_path: Path,
                                                              budget: float) -> None:
    """int8 quantizes each activation matrix of a pass as a whole (DynamicQuantizeMatMul), so a text's logits
    depend on what shares its pass: a split batch answers exactly as its passes would as batches of their own."""
    texts = texts_of(20, seed=1)
    options = EngineOptions(precision="int8", cache_dir=tmp_path)
    whole = load_engine(tiny_model_scope_checkpoint, options)
    assert isinstance(whole, EngineBase)
    cap = 3 * passes.activation_bytes(whole.shape, whole.plan(1.0), 1, whole.max_length)
    split = load_engine(tiny_model_scope_checkpoint, replace(options, max_activation_bytes=cap))
    assert isinstance(split, EngineBase)
    lengths = [n for n, _ in split.count_tokens(texts)]
    groups = passes.split(lengths, lambda b, n: passes.activation_bytes(split.shape, split.plan(budget), b, n) <= cap)
    assert len(groups) > 1
    result = split.predict(texts, budget)
    for idx in groups:
        alone = whole.predict([texts[i] for i in idx], budget)
        for i, p in zip(idx, alone.predictions, strict=True):
            assert result.predictions[i].logits == p.logits
    # And within quantization noise of the batch run whole.
    reference = whole.predict(texts, budget)
    got = np.array([p.logits for p in result.predictions])
    want = np.array([p.logits for p in reference.predictions])
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max() + 1e-3


def test_a_cap_below_one_text_is_refused_at_load(tiny_checkpoint: Path, tmp_path: Path) -> None:
    engine = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    assert isinstance(engine, EngineBase)
    one_text = passes.activation_bytes(engine.shape, engine.plan(1.0), 1, engine.max_length)
    load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path, max_activation_bytes=one_text))
    with pytest.raises(ModelLoadError, match="max_activation_bytes"):
        load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path, max_activation_bytes=one_text - 1))


# -- memory ----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_a_large_batch_gives_its_memory_back(minilm_shaped_checkpoint: Path, tmp_path: Path) -> None:
    """16 texts of 512 tokens in one pass (no cap) need ~400 MB of activations; once answered, the worker is back
    within 64 MB of where it was (ONNX Runtime's arena would keep it all)."""
    engine = load_engine(minilm_shaped_checkpoint, EngineOptions(precision="int8", cache_dir=tmp_path))
    engine.warmup()
    engine.predict(["a short text"], 0.5)
    before = rss_mb(os.getpid())
    with Sampler(os.getpid()) as sampler:
        result = engine.predict([" ".join(["word"] * 600)] * 16, 1.0)
    assert [p.n_tokens for p in result.predictions] == [512] * 16
    assert sampler.peak - before > 200  # the batch did take the memory
    assert rss_mb(os.getpid()) - before < 64
