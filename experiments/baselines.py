"""Baselines as ordinary checkpoints (METHODS.md section 4 and the evaluation protocol).

Every baseline is a ``BudgetedClassifier`` whose gate parameters *encode* the method's head ranking, so the
same mask policy (models/budget.py: heads ranked by crossing logit -a/beta, budget b keeps the first k),
the engine and the sweep all serve it unchanged:

- ``posthoc``: dense warm-start weights + the gradient-importance ranking (no training). Global, or
  structural (``GateConfig(structural=True)``: the best head of every layer first, a per-layer floor).
- ``posthoc+recovery``: that model fine-tuned one epoch at one fixed budget under its fixed hard mask,
  gates frozen, distilling from the dense model (T = 2); one artifact per budget.
- ``static``: gates trained for one fixed budget from the dense warm start (stage 2 with b fixed, then
  stage-3 hard adaptation at that b); one artifact per budget.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import torch

from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import GateConfig
from headbudget.training.batches import TokenizedSplit
from headbudget.training.recipes import Recipe
from headbudget.training.stages import StageResult, run_stage

# softplus(raw) = 1 exactly enough: beta = 1 makes g(b) = sigmoid((a + logit(b)) / tau).
_RAW_BETA_ONE = math.log(math.expm1(1.0))


def ranking_gates(ranking: np.ndarray, n_layers: int, n_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Gate parameters (a, raw_beta), each (L, H), whose crossing-budget order is ``ranking`` (best first).

    The head of rank r gets crossing budget b* = (r + 0.5) / (L * H), i.e. a = -logit(b*), beta = 1: its
    gate opens (g = 0.5) just as a budget buys it, so the soft gates mean something too (C(b) ~ b), and the
    ranks are strictly increasing crossing logits, so the ranking survives float32 storage without ties.
    """
    n = n_layers * n_heads
    ranking = np.asarray(ranking, dtype=np.int64)
    if sorted(ranking.tolist()) != list(range(n)):
        raise ValueError(f"ranking must be a permutation of 0..{n - 1}")
    rank = np.empty(n, dtype=np.int64)
    rank[ranking] = np.arange(n)
    b_star = (rank + 0.5) / n
    a = -np.log(b_star / (1.0 - b_star))
    raw = np.full(n, _RAW_BETA_ONE)
    return a.reshape(n_layers, n_heads), raw.reshape(n_layers, n_heads)


def with_ranking(model: BudgetedClassifier, ranking: np.ndarray, structural: bool = False) -> BudgetedClassifier:
    """A copy of ``model`` (same weights) whose gates serve ``ranking``; ``structural`` adds a per-layer floor."""
    cfg = replace(model.cfg, gate=replace(model.cfg.gate, structural=structural))
    out = BudgetedClassifier(cfg).to(model.classifier.weight.device)
    out.load_state_dict(model.state_dict())
    a, raw = ranking_gates(ranking, cfg.n_layers, cfg.n_heads)
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
