"""The three training stages of docs/method.md §6: dense warm start, budgeted fine-tune, hard adaptation."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from headbudget.models.adaptive import AdaptiveClassifier
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.model_types import Stage
from headbudget.training.batches import TokenizedSplit, batches
from headbudget.training.evaluation import accuracy, mean_accuracy
from headbudget.training.progress import Progress
from headbudget.training.recipes import Recipe

# Which stages a model type trains, in order, is its entry in models/model_types.py; what each stage does is its
# row of STAGES (at the end of this module).

# Learning rates of the parameters each adaptive type adds, when the recipe does not set adaptive_lr. The
# published BudgetFormer lr (2e-5 for everything) leaves its zero-initialised relevance net near uniform
# within the two epochs a CPU run affords, so the new parts get their own: 1e-3 for BudgetFormer's f and g,
# 1e-2 for the span ratios (one number per head, in [0, 1]) and for AdaAttention's scorer (at 1e-3 its scores
# moved from 0.95 to 0.95 in 562 steps on AG News: no head was reduced; see AdaConfig.init_bias).
ADAPTIVE_LR = {"budgetformer": 1e-3, "span": 1e-2, "adaattention": 1e-2}
# Adaptive types choose their weights among evaluations in the second half of the stage: earlier ones are
# taken before the schedules (temperature, noise, lambda) have done their work and would win on accuracy alone.
ADAPT_SELECT_FROM = 0.5
# "recover" (baselines, docs/method.md §9): fine-tune the encoder under the model's fixed hard mask at one
# budget, gates frozen, distilling from a dense teacher; run with ``fixed_budget``.


@dataclass(frozen=True)
class StageResult:
    """What a finished stage reports (also written to its done.json)."""

    stage: str
    steps: int
    # Selection metric of the kept weights; None where the stage's one evaluation would have selected nothing and
    # was not run (run_stage's ``final``).
    best_val: float | None
    history: list[dict[str, float]]
    seconds: float


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
                      alpha: float, temperature: float) -> torch.Tensor:
    """alpha * CE(student, y) + (1 - alpha) * T^2 * KL(softmax(teacher / T) || softmax(student / T))."""
    t = temperature
    kl = F.kl_div(F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1), log_target=True,
                  reduction="batchmean")
    return alpha * F.cross_entropy(student, labels) + (1.0 - alpha) * t * t * kl


def budget_losses(model: BudgetedClassifier, gates: torch.Tensor, b: float, recipe: Recipe) -> torch.Tensor:
    """lambda_cost * C(b) + lambda_violation * max(0, C(b) - b)^2 for one batch's gates (1, L, U)."""
    cost = model.soft_cost(gates)[0]
    return recipe.lambda_cost * cost + recipe.lambda_violation * F.relu(cost - b) ** 2


def _optimizer(model: BudgetedClassifier, recipe: Recipe, stage: Stage, steps: int):
    gate_params = list(model.gates.parameters())
    frozen = {id(model.encoder.embeddings.word.weight)} if recipe.freeze_embeddings else set()
    extra = model.adaptive_parameters() if isinstance(model, AdaptiveClassifier) else []
    exits = list(model.exits.parameters())
    extra_ids = {id(p) for p in extra + exits}
    body = [p for n, p in model.named_parameters()
            if not n.startswith("gates.") and id(p) not in frozen and id(p) not in extra_ids]
    for p in model.parameters():
        p.requires_grad_(id(p) not in frozen)
    groups = [{"params": body, "lr": recipe.lr, "weight_decay": recipe.weight_decay}]
    if extra:
        lr = recipe.adaptive_lr or ADAPTIVE_LR[model.cfg.model_type]
        groups.append({"params": extra, "lr": lr, "weight_decay": 0.0})
    if exits:
        groups.append({"params": exits, "lr": recipe.exit_lr, "weight_decay": 0.0})
    if STAGES[stage].trains_gates:
        groups.append({"params": gate_params, "lr": recipe.gate_lr, "weight_decay": 0.0})
    else:
        for p in gate_params:
            p.requires_grad_(False)
    # On CPU the fused kernel updates every tensor in one call, where torch's default there loops over them in
    # Python (docs/decisions.md, 2026-11-29); on CUDA torch's own default stays, so runs there repeat exactly.
    on_cpu = all(p.device.type == "cpu" for g in groups for p in g["params"])
    opt = torch.optim.AdamW(groups, fused=True if on_cpu else None)
    warm = max(1, int(steps * recipe.warmup_fraction))

    def lr_factor(s: int) -> float:  # linear warm-up, then linear decay to zero
        return (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    return opt, sched


def budget_violation(model: BudgetedClassifier, budgets: tuple[float, ...]) -> float:
    """Largest soft-cost overshoot max_b max(0, C(b) - b) over the selection budgets."""
    with torch.no_grad():
        dev = model.gates.logit.device
        costs = model.soft_cost(model.soft_gates(torch.tensor(budgets, device=dev)))  # (n_budgets,)
    return float(max(0.0, max(c - b for c, b in zip(costs.tolist(), budgets, strict=True))))


# Stage 2 keeps a state only if its soft cost stays within this much of every selection budget.
VIOLATION_TOLERANCE = 0.05


def _select_metric(model: BudgetedClassifier, val: TokenizedSplit, stage: Stage, recipe: Recipe) -> float:
    selection = STAGES[stage].selection
    if selection == "dense":  # adapt: eval mode runs the adaptive model as it will be served
        return accuracy(model, val, "dense")
    if selection == "soft":
        # Selecting on soft accuracy alone picked the first evaluation, taken before the gates had learned
        # to close (measured on AG News and SST-2: stage-2 "best" equalled the dense model, soft cost stuck
        # at 0.35-0.63 for b = 0.1). A state that overspends its budget is not a budgeted model, so such
        # states rank below every one that keeps the budget, and among themselves by how little they overspend.
        violation = budget_violation(model, recipe.val_budgets)
        if violation > VIOLATION_TOLERANCE:
            return -violation
    return mean_accuracy(model, val, selection, recipe.val_budgets)


def _schedule(n_train: int, recipe: Recipe, epochs: float) -> tuple[int, int, int]:
    """(examples used, optimizer steps, steps between evaluations) of one stage."""
    n = min(n_train, recipe.examples_per_stage or n_train)
    steps_per_epoch = math.ceil(n / recipe.batch_size)
    steps = max(1, int(round(epochs * steps_per_epoch)))
    return n, steps, max(1, steps_per_epoch // max(1, recipe.evals_per_epoch))


def _train_step(model: BudgetedClassifier, adaptive: AdaptiveClassifier | None, stage: Stage, recipe: Recipe,
                batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: float,
                teacher: BudgetedClassifier | None, opt: torch.optim.Optimizer,
                sched: torch.optim.lr_scheduler.LRScheduler, progress: float) -> torch.Tensor:
    """One optimizer step on one batch at budget ``b``; returns the batch's loss."""
    ids, mask, y = batch
    if adaptive is not None:
        out = adaptive.forward_adaptive(ids, mask, progress=progress)
        loss = F.cross_entropy(out.logits, y) + out.aux_loss
    else:
        loss = _stage_loss(model, stage, recipe, ids, mask, y, b, teacher)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


@dataclass
class _Selection:
    """The best validation figure of a stage so far, the weights that reached it, and every evaluation."""

    best: float
    state: dict[str, torch.Tensor]
    history: list[dict[str, float]]

    def evaluate(self, model: BudgetedClassifier, val: TokenizedSplit, stage: Stage, recipe: Recipe,
                 loss: torch.Tensor, step: int, steps: int, adaptive: bool) -> None:
        # An adaptive model is evaluated as served: its plain forward runs at progress 1.0 (final
        # temperature) and eval mode adds no noise.
        metric = _select_metric(model, val, stage, recipe)
        eligible = not adaptive or step / steps >= ADAPT_SELECT_FROM or step == steps
        self.history.append({"step": step, "val": metric, "loss": float(loss.item()),
                             "violation": budget_violation(model, recipe.val_budgets)})
        if eligible and metric > self.best:
            self.best, self.state = metric, copy.deepcopy(model.state_dict())
        model.train()


def run_stage(
    model: BudgetedClassifier, stage: Stage, recipe: Recipe, train: TokenizedSplit, val: TokenizedSplit,
    seed: int, teacher: BudgetedClassifier | None = None, fixed_budget: float | None = None, final: bool = True,
) -> StageResult:
    """Train ``model`` in place for one stage and leave it holding the best weights seen on validation.

    ``fixed_budget`` trains every batch at that budget instead of b ~ U[b_min, 1] (the per-budget baselines).
    ``final`` False: a stage another follows, or whose model its caller measures itself; if it evaluates only once, at
    its end, that evaluation selects nothing (the last weights are kept either way) and is skipped: every stage of
    the `quick` recipe in ``make run``.
    """
    import time

    t0 = time.perf_counter()
    device = next(model.parameters()).device
    spec = STAGES[stage]
    adaptive = model if spec.adaptive and isinstance(model, AdaptiveClassifier) else None
    if spec.adaptive and adaptive is None:
        raise ValueError("the adapt stage needs an adaptive model type (budgetformer, span, adaattention)")
    n, steps, eval_every = _schedule(len(train), recipe, spec.epochs(recipe))
    evaluates = final or eval_every < steps
    opt, sched = _optimizer(model, recipe, stage, steps)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    selection = _Selection(-1.0, copy.deepcopy(model.state_dict()) if evaluates else {}, [])
    bar = Progress(steps, stage)
    # The bar shows a budget only where the loss takes one: the dense and adapt stages draw one they never use
    # (the draw stays, so that a run's random stream, hence its result, is what it was).
    shows_budget = spec.samples_budget
    step = 0
    model.train()
    while step < steps:
        subset = TokenizedSplit(train.ids[:n], train.labels[:n], 0)
        for batch in batches(subset, recipe.batch_size, device, shuffle=True, rng=rng, bucket=recipe.length_buckets):
            b = float(rng.uniform(recipe.b_min, 1.0)) if fixed_budget is None else fixed_budget
            loss = _train_step(model, adaptive, stage, recipe, batch, b, teacher, opt, sched, step / steps)
            step += 1
            # The validation figure once there is one (the quick recipe evaluates once, at a stage's end).
            bar.update(loss=f"{loss.item():.3f}", **({"b": f"{b:.2f}"} if shows_budget else {}),
                       **({"val": f"{selection.best:.3f}"} if selection.history else {}))
            if evaluates and (step % eval_every == 0 or step == steps):
                selection.evaluate(model, val, stage, recipe, loss, step, steps, adaptive is not None)
            if step >= steps:
                break
    bar.close()
    if selection.history:
        model.load_state_dict(selection.state)
    model.eval()
    return StageResult(stage, steps, selection.best if selection.history else None, selection.history,
                       time.perf_counter() - t0)


def _stage_loss(
    model: BudgetedClassifier, stage: Stage, recipe: Recipe, ids: torch.Tensor, mask: torch.Tensor,
    y: torch.Tensor, b: float, teacher: BudgetedClassifier | None,
) -> torch.Tensor:
    """One batch's loss in ``stage`` at budget ``b`` (``STAGES``; the adapt stage's is the adaptive type's own)."""
    loss = STAGES[stage].loss
    assert loss is not None, f"the {stage} stage's loss is the adaptive type's own"
    return loss(model, recipe, ids, mask, y, b, teacher)


def _dense_loss(model: BudgetedClassifier, recipe: Recipe, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor,
                b: float, teacher: BudgetedClassifier | None) -> torch.Tensor:
    return F.cross_entropy(model(ids, mask), y)


def _recover_loss(model: BudgetedClassifier, recipe: Recipe, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor,
                  b: float, teacher: BudgetedClassifier | None) -> torch.Tensor:
    assert teacher is not None, "recovery distils from the dense model"
    with torch.no_grad():
        t_logits = teacher(ids, mask)  # dense: every head, no gates
    # the fixed pruning mask; gates are frozen
    s_logits = model(ids, mask, model.hard_gates(b), model.hard_depth(b))
    return distillation_loss(s_logits, t_logits, y, recipe.distill_alpha, recipe.distill_temperature)


def _sandwich(recipe: Recipe, b: float) -> tuple[float, ...]:
    """The budgets one batch trains at: b, or with the sandwich rule 1, b_min and b."""
    return (1.0, recipe.b_min, b) if recipe.sandwich else (b,)


def _budget_loss(model: BudgetedClassifier, recipe: Recipe, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor,
                 b: float, teacher: BudgetedClassifier | None) -> torch.Tensor:
    budgets = _sandwich(recipe, b)
    if recipe.fused_sandwich and len(budgets) > 1:
        return _fused_budget_loss(model, recipe, ids, mask, y, budgets)
    gates = model.soft_gates(torch.tensor(budgets, device=ids.device))  # (n_budgets, L, U)
    losses = [F.cross_entropy(model(ids, mask, gates[i]), y) + budget_losses(model, gates[i:i + 1], bi, recipe)
              for i, bi in enumerate(budgets)]
    return torch.stack(losses).mean()


def _hard_stage_loss(model: BudgetedClassifier, recipe: Recipe, ids: torch.Tensor, mask: torch.Tensor,
                     y: torch.Tensor, b: float, teacher: BudgetedClassifier | None) -> torch.Tensor:
    budgets = _sandwich(recipe, b)
    assert teacher is not None, "hard adaptation distils from the frozen stage-2 (or dense) model"
    if recipe.fused_sandwich and len(budgets) > 1:
        return _fused_hard_loss(model, recipe, ids, mask, y, budgets, teacher)
    dense_teacher = recipe.hard_teacher == "dense"
    with torch.no_grad():
        # The dense teacher's answer does not depend on the budget: one forward pass serves every budget.
        shared = teacher.logits_and_states(ids, mask) if dense_teacher else None
    policy = model.gates.policy()  # the gates move only at the optimizer step: one ranking for the whole batch
    losses = []
    for bi in budgets:
        bt = torch.tensor([bi], device=ids.device)
        if shared is None:
            with torch.no_grad():
                t_logits, t_states = teacher.logits_and_states(ids, mask, teacher.soft_gates(bt)[0])
        else:
            t_logits, t_states = shared
        # Straight-through: the forward pass uses the serving mask (same crossing-budget ranking), the
        # backward pass reaches the gate parameters through g(b).
        s_logits, s_states = model.logits_and_states(ids, mask, model.ste_gates(bt, policy)[0],
                                                     policy.plan(bi).depth)
        losses.append(_hard_loss(s_logits, s_states, t_logits, t_states, mask, y, recipe))
    return torch.stack(losses).mean()


def _hard_loss(
    s_logits: torch.Tensor, s_states: list[torch.Tensor], t_logits: torch.Tensor, t_states: list[torch.Tensor],
    mask: torch.Tensor, y: torch.Tensor, recipe: Recipe,
) -> torch.Tensor:
    """Stage 3's loss at one budget: distillation on the logits, plus the hidden-state term if the recipe has one."""
    loss = distillation_loss(s_logits, t_logits, y, recipe.distill_alpha, recipe.distill_temperature)
    if recipe.hidden_distill > 0:
        real = mask.to(s_logits.dtype)[:, :, None]  # (B, N, 1): the error counts real tokens only
        # A plan that stops at an exit is compared on the layers it runs.
        mse = [(((s - t) ** 2) * real).sum() / (real.sum() * s.shape[-1])
               for s, t in zip(s_states, t_states[:len(s_states)], strict=True)]
        loss = loss + recipe.hidden_distill * torch.stack(mse).mean()
    return loss


def _fused_budget_loss(model: BudgetedClassifier, recipe: Recipe, ids: torch.Tensor, mask: torch.Tensor,
                       y: torch.Tensor, budgets: tuple[float, ...]) -> torch.Tensor:
    """The sandwich's loss from one forward pass: the batch repeated once per budget, each copy with its gates."""
    bsz = ids.shape[0]
    ids_r, mask_r, bt = _repeated(ids, mask, budgets)
    gates = model.soft_gates(bt)  # (nb, L, U)
    logits = model(ids_r, mask_r, gates.repeat_interleave(bsz, dim=0)).split(bsz)
    return torch.stack([F.cross_entropy(logits[i], y) + budget_losses(model, gates[i:i + 1], bi, recipe)
                        for i, bi in enumerate(budgets)]).mean()


def _fused_hard_loss(model: BudgetedClassifier, recipe: Recipe, ids: torch.Tensor, mask: torch.Tensor,
                     y: torch.Tensor, budgets: tuple[float, ...], teacher: BudgetedClassifier) -> torch.Tensor:
    """Stage 3's sandwich from one forward pass of the student (and of a soft teacher), as ``_fused_budget_loss``."""
    nb, bsz = len(budgets), ids.shape[0]
    ids_r, mask_r, bt = _repeated(ids, mask, budgets)
    with torch.no_grad():
        if recipe.hard_teacher == "dense":
            t_one, t_st = teacher.logits_and_states(ids, mask)
            t_logits, t_states = [t_one] * nb, [t_st] * nb
        else:
            t_all, t_st_all = teacher.logits_and_states(
                ids_r, mask_r, teacher.soft_gates(bt).repeat_interleave(bsz, dim=0))
            t_logits = list(t_all.split(bsz))
            t_states = [[s.split(bsz)[i] for s in t_st_all] for i in range(nb)]
    policy = model.gates.policy()
    s_all, s_st_all = model.logits_and_states(ids_r, mask_r, model.ste_gates(bt, policy).repeat_interleave(bsz, dim=0),
                                              model.depth_of(budgets, policy).repeat_interleave(bsz).to(ids.device))
    s_logits = s_all.split(bsz)
    return torch.stack([
        _hard_loss(s_logits[i], [s.split(bsz)[i] for s in s_st_all], t_logits[i], t_states[i], mask, y, recipe)
        for i in range(nb)]).mean()


def _repeated(ids: torch.Tensor, mask: torch.Tensor, budgets: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    """The batch once per budget, (nb*B, N) ids and mask (copy i runs at budgets[i]), and the budgets (nb,)."""
    nb = len(budgets)
    return ids.repeat(nb, 1), mask.repeat(nb, 1), torch.tensor(budgets, device=ids.device)


_Loss = Callable[[BudgetedClassifier, Recipe, torch.Tensor, torch.Tensor, torch.Tensor, float,
                  BudgetedClassifier | None], torch.Tensor]


@dataclass(frozen=True)
class StageSpec:
    """What one stage trains and how (docs/method.md §6)."""

    epochs: Callable[[Recipe], float]  # its length, from the recipe
    loss: _Loss | None  # one batch's loss at its budget; None: the adaptive type's own (forward_adaptive)
    trains_gates: bool  # the gate parameters learn (frozen otherwise)
    samples_budget: bool  # its loss takes the batch's budget, b ~ U[b_min, 1] (or the fixed one)
    # The accuracy that picks the weights it keeps: unmasked, or the mean over the recipe's val_budgets with
    # soft gates (among states that keep their budget, budget_violation) or the hard mask.
    selection: Literal["dense", "soft", "hard"]
    adaptive: bool = False  # it trains an adaptive type (the trainer converts the dense warm start first)
    # The stage whose frozen model it distils from, by recipe (the trainer loads it); None: no teacher, or (the
    # per-budget recovery) one its caller passes.
    teacher: Callable[[Recipe], str] | None = None
    starts_exits: bool = False  # exit heads start here as copies of the classifier, and train from here on
    skipped_by_a_trained_head: bool = False  # a base that is already a classifier of the data's labels skips it


STAGES: Mapping[Stage, StageSpec] = MappingProxyType({
    "dense": StageSpec(epochs=lambda r: r.dense_epochs, loss=_dense_loss, trains_gates=False, samples_budget=False,
                       selection="dense", skipped_by_a_trained_head=True),
    "budget": StageSpec(epochs=lambda r: r.budget_epochs, loss=_budget_loss, trains_gates=True, samples_budget=True,
                        selection="soft"),
    # From the stage-2 soft model or the dense one (Recipe.hard_teacher).
    "hard": StageSpec(epochs=lambda r: r.hard_epochs, loss=_hard_stage_loss, trains_gates=True, samples_budget=True,
                      selection="hard", teacher=lambda r: "budget" if r.hard_teacher == "soft" else "dense",
                      starts_exits=True),
    "recover": StageSpec(epochs=lambda r: r.hard_epochs, loss=_recover_loss, trains_gates=False, samples_budget=True,
                         selection="hard"),
    "adapt": StageSpec(epochs=lambda r: r.adapt_epochs, loss=None, trains_gates=False, samples_budget=False,
                       selection="dense", adaptive=True),
})
