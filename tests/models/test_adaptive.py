"""The adaptive model types: config round trip, dense start, inference choices, gradients and checkpoints."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from headbudget.models.adaattention import ada_lambda, reduced_dims
from headbudget.models.adaptive import AdaptiveClassifier
from headbudget.models.budgetformer import BudgetFormerClassifier, budget_cap_heads
from headbudget.models.checkpoint import load_checkpoint, save_checkpoint
from headbudget.models.config import AdaConfig, GateConfig, ModelConfig
from headbudget.models.factory import to_model_type
from headbudget.models.pretrained import random_init
from headbudget.models.span import SpanClassifier, span_window

LABELS = ("a", "b")


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 5000, (3, 40), generator=g)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 25:] = 0
    mask[2, 9:] = 0
    return ids, mask


def test_config_round_trip_keeps_the_type_and_its_section() -> None:
    cfg = ModelConfig(model_type="span", span=replace(ModelConfig().span, ramp=16))
    back = ModelConfig.from_dict(cfg.to_dict())
    assert back == cfg and back.span.ramp == 16
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig(model_type="nope")
    with pytest.raises(ValueError, match="unknown span config"):
        ModelConfig.from_dict({**cfg.to_dict(), "span": {"bogus": 1}})


@pytest.mark.parametrize("kind", ["span", "adaattention"])
def test_span_and_ada_start_exactly_as_the_dense_model(kind: str) -> None:
    dense = random_init(LABELS, GateConfig(), seed=1).eval()
    model = to_model_type(dense, kind).eval()
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask), dense(ids, mask), atol=1e-5, rtol=0)


def test_budgetformer_keeps_top_k_heads_per_input_and_respects_a_cap() -> None:
    model = random_init(LABELS, GateConfig(), seed=2, model_type="budgetformer").eval()
    assert isinstance(model, BudgetFormerClassifier)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a in model.adaptive_layers():
            a.relevance.weight.copy_(torch.randn(a.relevance.weight.shape, generator=g))  # type: ignore[union-attr]
            a.budget_out.weight.copy_(torch.randn(a.budget_out.weight.shape, generator=g))  # type: ignore[union-attr]
    ids, mask = _inputs()
    with torch.no_grad():
        out = model.forward_adaptive(ids, mask)
        free = out.usage["heads"]  # (B, L)
        s = out.usage["s"]
        expected = torch.clamp(torch.floor(s * model.cfg.n_heads), 1, model.cfg.n_heads)
        assert torch.equal(free, expected)
        capped_out = model.forward_adaptive(ids, mask, cap=0.25)
        capped = capped_out.usage["heads"]
        # Nothing is left on the model: a plain forward after a capped one is the uncapped pass again.
        torch.testing.assert_close(model(ids, mask), out.logits, atol=0, rtol=0)
    assert torch.all(capped <= budget_cap_heads(0.25, model.cfg.n_heads)) and torch.all(capped <= free)
    assert budget_cap_heads(0.0, 12) == 1 and budget_cap_heads(1.0, 12) == 12 and budget_cap_heads(0.5, 12) == 6


def test_span_window_is_where_the_ramp_reaches_zero() -> None:
    cfg = replace(ModelConfig(), model_type="span", max_position=128, hidden_size=64, n_heads=4, n_layers=2,
                  intermediate_size=128)
    model = SpanClassifier(cfg)
    a = model.adaptive_layers()[0]
    with torch.no_grad():
        a.span_ratio.copy_(torch.tensor([0.0, 0.1, 0.25, 1.0]))  # type: ignore[operator]
    m = a.ramp_mask(100, torch.device("cpu"))  # type: ignore[operator]
    for h, z in enumerate(a.spans().detach().tolist()):  # type: ignore[operator]
        w = span_window(z, cfg.span.ramp)
        row = m[h, 50]
        visible = (row > 0).nonzero().flatten()
        assert int((visible - 50).abs().max()) == min(w - 1, 50)


def test_ada_dims_and_lambda_schedule() -> None:
    score = torch.tensor([[0.9, 0.5, 0.2, 0.01]])
    assert reduced_dims(score, 32, 0.5).tolist() == [[32, 16, 6, 1]]
    cfg = AdaConfig()
    assert ada_lambda(cfg, 0.05) == 0.0 and ada_lambda(cfg, 0.5) == cfg.lambda_mid
    assert ada_lambda(cfg, 1.0) == pytest.approx(cfg.lambda_end)
    assert cfg.lambda_mid < ada_lambda(cfg, 0.975) < cfg.lambda_end


@pytest.mark.parametrize("kind", ["budgetformer", "span", "adaattention"])
def test_adaptive_parameters_get_gradients_and_checkpoints_round_trip(kind: str, tmp_path: Path) -> None:
    model = random_init(LABELS, GateConfig(), seed=3, model_type=kind)
    assert isinstance(model, AdaptiveClassifier)
    model.train()
    ids, mask = _inputs()
    out = model.forward_adaptive(ids, mask, progress=0.6)
    assert out.aux_loss.dim() == 0 and all(v.shape[:2] == (3, model.cfg.n_layers) for v in out.usage.values())
    loss = out.logits.logsumexp(-1).mean() + out.aux_loss
    loss.backward()
    extra = model.adaptive_parameters()
    assert extra and all(p.grad is not None and torch.isfinite(p.grad).all() for p in extra)
    assert any(float(p.grad.abs().sum()) > 0 for p in extra)  # type: ignore[union-attr]
    model.eval()
    save_checkpoint(model, tmp_path, {"model_type": kind})
    loaded, config = load_checkpoint(tmp_path)
    assert type(loaded) is type(model) and loaded.cfg.model_type == kind
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask), model(ids, mask), atol=0, rtol=0)
