"""Baselines as ordinary checkpoints (docs/method.md §9 and §10).

Every baseline is a ``BudgetedClassifier`` whose gate parameters *encode* the method's head ranking, so the
same mask policy (models/budget.py: heads ranked by crossing logit -a/beta, budget b keeps the first k),
the engine and the sweep all serve it unchanged:

- ``posthoc``: dense warm-start weights + the gradient-importance ranking (no training). Global, or
  structural (``GateConfig(structural=True)``: the best head of every layer first, a per-layer floor).
- ``posthoc+recovery``: that model fine-tuned one epoch at one fixed budget under its fixed hard mask,
  gates frozen, distilling from the dense model (T = 2); one artifact per budget.
- ``static``: gates trained for one fixed budget from the dense warm start (stage 2 with b fixed, then
  stage-3 hard adaptation at that b); one artifact per budget.

Whole-model budgets (docs/method.md §4): the same encoding ranks every unit, heads and feed-forward
groups (``posthoc-model``: the gradient-importance ranking over all units), and the dedicated small models a
user would train instead are dense attention-scope checkpoints cut from the dense warm start and fine-tuned
with dense-teacher distillation: ``drop_top_layers`` (the first layers only) and ``keep_neurons`` (each
layer's most important feed-forward neurons).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import torch

from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import GateConfig, ModelConfig
from headbudget.training.batches import TokenizedSplit
from headbudget.training.recipes import Recipe
from headbudget.training.stages import StageResult, run_stage

# softplus(raw) = 1 exactly enough: beta = 1 makes g(b) = sigmoid((a + logit(b)) / tau).
_RAW_BETA_ONE = math.log(math.expm1(1.0))


def ranking_gates(ranking: np.ndarray, n_layers: int, n_units: int) -> tuple[np.ndarray, np.ndarray]:
    """Gate parameters (a, raw_beta), each (L, U), whose crossing-budget order is ``ranking`` (best first).

    U is the gate units per layer: the heads (attention scope), or the heads then the feed-forward groups.
    The unit of rank r gets crossing budget b* = (r + 0.5) / (L * U), i.e. a = -logit(b*), beta = 1: its
    gate opens (g = 0.5) just as a budget buys it, so the soft gates mean something too (C(b) ~ b), and the
    ranks are strictly increasing crossing logits, so the ranking survives float32 storage without ties.
    """
    n = n_layers * n_units
    ranking = np.asarray(ranking, dtype=np.int64)
    if sorted(ranking.tolist()) != list(range(n)):
        raise ValueError(f"ranking must be a permutation of 0..{n - 1}")
    rank = np.empty(n, dtype=np.int64)
    rank[ranking] = np.arange(n)
    b_star = (rank + 0.5) / n
    a = -np.log(b_star / (1.0 - b_star))
    raw = np.full(n, _RAW_BETA_ONE)
    return a.reshape(n_layers, n_units), raw.reshape(n_layers, n_units)


def with_ranking(model: BudgetedClassifier, ranking: np.ndarray, structural: bool = False) -> BudgetedClassifier:
    """A copy of ``model`` (same weights) whose gates serve ``ranking``; ``structural`` adds a per-layer floor.

    ``ranking`` is over the model's gate units: its heads, or (whole-model scope) its heads and feed-forward groups.
    """
    cfg = replace(model.cfg, gate=replace(model.cfg.gate, structural=structural))
    out = BudgetedClassifier(cfg).to(model.classifier.weight.device)
    out.load_state_dict(model.state_dict())
    a, raw = ranking_gates(ranking, cfg.n_layers, cfg.units_per_layer)
    with torch.no_grad():
        out.gates.logit.copy_(torch.as_tensor(a, dtype=out.gates.logit.dtype))
        out.gates.raw_beta.copy_(torch.as_tensor(raw, dtype=out.gates.raw_beta.dtype))
    return out.eval()


def reset_gates(model: BudgetedClassifier) -> BudgetedClassifier:
    """A copy of ``model`` with gates at their initial values (g ~ 1 everywhere): a stage-2 starting point."""
    out = copy.deepcopy(model)
    g: GateConfig = out.cfg.gate
    with torch.no_grad():
        out.gates.logit.fill_(g.init_logit)
        out.gates.raw_beta.fill_(g.init_raw_beta)
    return out


def recover(model: BudgetedClassifier, budget: float, recipe: Recipe, train: TokenizedSplit,
            val: TokenizedSplit, teacher: BudgetedClassifier, seed: int) -> StageResult:
    """Recovery fine-tune in place: ``recipe.hard_epochs`` at ``budget`` under the model's fixed hard mask."""
    r = replace(recipe, val_budgets=(budget,))
    return run_stage(model, "recover", r, train, val, seed=seed, teacher=teacher.eval(), fixed_budget=budget)


def static_soft(model: BudgetedClassifier, budget: float, recipe: Recipe, train: TokenizedSplit,
                val: TokenizedSplit, seed: int) -> StageResult:
    """Stage 2 at one fixed budget, in place: CE + cost and violation penalties with b fixed."""
    r = replace(recipe, val_budgets=(budget,))
    return run_stage(model, "budget", r, train, val, seed=seed, fixed_budget=budget)


def static_hard(model: BudgetedClassifier, budget: float, recipe: Recipe, train: TokenizedSplit,
                val: TokenizedSplit, teacher: BudgetedClassifier, seed: int) -> StageResult:
    """Stage-3 hard adaptation at one fixed budget, in place, distilling from the static soft model."""
    r = replace(recipe, val_budgets=(budget,))
    return run_stage(model, "hard", r, train, val, seed=seed, teacher=teacher.eval(), fixed_budget=budget)


def _dense_copy(model: BudgetedClassifier, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> BudgetedClassifier:
    """A model of ``cfg`` holding ``state`` (every weight but the gates), gates at their initial values."""
    out = BudgetedClassifier(cfg).to(model.classifier.weight.device, model.classifier.weight.dtype)
    state = {k: v for k, v in state.items() if not k.startswith("exits.")}  # a plain checkpoint has no exits
    missing, unexpected = out.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("gates.") for k in missing):
        raise ValueError(f"conversion left weights out: missing {missing}, unexpected {unexpected}")
    return out.eval()


def _attention_scope(cfg: ModelConfig, **changes: int) -> ModelConfig:
    """``cfg`` with ``changes`` as a plain attention-scope checkpoint: every head kept at b = 1 (gates open)."""
    return replace(cfg, **changes, gate=replace(cfg.gate, scope="attention", structural=False, exits=()))


def attention_scope_copy(model: BudgetedClassifier) -> BudgetedClassifier:
    """``model``'s weights as a plain attention-scope checkpoint: fresh gates, no exits."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("gates.")}
    return _dense_copy(model, _attention_scope(model.cfg), state)


def drop_top_layers(model: BudgetedClassifier, n_keep: int) -> BudgetedClassifier:
    """The dense model's first ``n_keep`` layers (and its embeddings and classifier): LayerDrop's top layers dropped."""
    if not 1 <= n_keep <= model.cfg.n_layers:
        raise ValueError(f"n_keep must be in [1, {model.cfg.n_layers}], got {n_keep}")
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("gates.")
             and not (k.startswith("encoder.layers.") and int(k.split(".")[2]) >= n_keep)}
    return _dense_copy(model, _attention_scope(model.cfg, n_layers=n_keep), state)


def keep_neurons(model: BudgetedClassifier, keep: np.ndarray) -> BudgetedClassifier:
    """The dense model with only the feed-forward neurons ``keep`` (L, I') of each layer: rows of W1 and b1 and
    columns of W2 (a layer's neurons keep their original order)."""
    keep = np.asarray(keep, dtype=np.int64)
    n_layers, width = model.cfg.n_layers, model.cfg.intermediate_size
    if keep.ndim != 2 or keep.shape[0] != n_layers or any(len(set(row.tolist())) != keep.shape[1] for row in keep) \
            or keep.min() < 0 or keep.max() >= width:
        raise ValueError(f"keep must be (L={n_layers}, I') distinct neuron indices below {width}")
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("gates.")}
    for layer, row in enumerate(keep):
        idx = torch.as_tensor(np.sort(row), device=model.classifier.weight.device)
        p = f"encoder.layers.{layer}."
        state[p + "intermediate.weight"] = state[p + "intermediate.weight"][idx]  # (I', D)
        state[p + "intermediate.bias"] = state[p + "intermediate.bias"][idx]  # (I',)
        state[p + "ffn_out.weight"] = state[p + "ffn_out.weight"][:, idx]  # (D, I')
    return _dense_copy(model, _attention_scope(model.cfg, intermediate_size=keep.shape[1]), state)


def top_neurons(scores: np.ndarray, n_keep: int) -> np.ndarray:
    """Per layer, the ``n_keep`` neurons of highest score (ties by index), in index order: (L, n_keep)."""
    rows = [np.sort(np.lexsort((np.arange(row.size), -row))[:n_keep]) for row in np.asarray(scores)]
    return np.stack(rows).astype(np.int64)


def distil_small(model: BudgetedClassifier, recipe: Recipe, train: TokenizedSplit, val: TokenizedSplit,
                 teacher: BudgetedClassifier, seed: int) -> StageResult:
    """Fine-tune a dedicated small model in place: the recovery stage at b = 1 (every head), ``recipe.hard_epochs``,
    distilling from the dense model, alpha * CE + (1 - alpha) * T^2 * KL with the recipe's alpha and T (0.5, 2)."""
    return recover(model, 1.0, recipe, train, val, teacher, seed)


def small_model(method: str, dense: BudgetedClassifier, neuron_scores: np.ndarray | None, recipe: Recipe,
                train: TokenizedSplit, val: TokenizedSplit, seed: int) -> BudgetedClassifier:
    """A dedicated small model cut from the dense warm start, then distilled from it (one artifact, b = 1).

    ``layerdrop``: the first L - L // 2 layers (MiniLM: its top 3 of 6 dropped). ``ffn-half``: the I / 2
    feed-forward neurons of each layer with the highest ``neuron_scores`` (L, I). Both start from the fine-tuned
    dense weights, not from the pre-trained encoder: the user has that model already (it is the teacher), and a
    one-epoch distillation from a fresh classifier would not be the fair baseline (a choice, not a measurement).
    """
    c = dense.cfg
    if method == "layerdrop":
        model = drop_top_layers(dense, c.n_layers - c.n_layers // 2)
    elif method == "ffn-half":
        if neuron_scores is None:
            raise ValueError("ffn-half needs per-neuron importance scores")
        model = keep_neurons(dense, top_neurons(neuron_scores, c.intermediate_size // 2))
    else:
        raise ValueError(f"unknown small model {method!r}")
    distil_small(model, recipe, train, val, dense, seed)
    return model
