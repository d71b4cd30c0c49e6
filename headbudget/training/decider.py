"""Make a budgeted checkpoint's decider for ``budget=auto`` (engine/decider.py): calibrated after training, on
the validation split, from every grid budget's answers as the serving engine computes them.

Costs here are what the service reports: a text's whole-forward multiply-adds over all its passes, as a share of
one dense pass at its own length. A ``target`` is a fixed budget T: an operating point calibrated for T spends on
average no more than running every text at T would (the same measure on every scope: on an attention-scope
checkpoint a second pass pays the feed-forward blocks again, and this counts it).

- Cascade: every (cheap stage, escalation stage) pair of grid budgets and every threshold on the cheap pass's
  max probability (its quantiles on the split) is a candidate; for a target, the most accurate candidate within
  it (single fixed budgets are candidates too). The escalation stage is chosen freely among the budgets above
  the cheap one, not only the cap: ``meta.cap_only`` records, per target, what escalating to 1.0 only reached.
- Predictor: per text, the smallest grid budget at which the answer is right at it and at every larger budget
  (texts wrong at 1.0 get the smallest: no budget buys them a right answer); a multinomial logistic regression
  (numpy features, scipy L-BFGS, L2 chosen on held-out likelihood) on one half of the split, its threshold
  ``tau`` per target on the other half.

The default operating point (``auto`` alone): the cheapest whose accuracy on the calibration texts is within
``tolerance`` of the fixed budget 1.0 on the same texts ("the right answer, as cheaply as possible"), else the
most accurate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from headbudget.engine.base import EngineBase
from headbudget.engine.decider import (
    DEFAULT_KIND,
    CascadePoint,
    Decider,
    DeciderKind,
    Point,
    Predictor,
    PredictorPoint,
)
from headbudget.models.budget import BUDGET_GRID
from headbudget.training.data import Split

log = logging.getLogger(__name__)

TARGETS: tuple[float, ...] = (0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75)
TOLERANCE = 0.005  # the default point: within half a point of the whole budget's accuracy
N_THRESHOLDS = 64  # cascade thresholds tried per stage pair (quantiles of the cheap pass's confidence)
TAUS = tuple(np.round(np.linspace(0.02, 0.99, 98), 4).tolist())  # predictor thresholds tried
L2_GRID = (0.01, 0.1, 1.0, 10.0)


@dataclass(frozen=True)
class Passes:
    """Every grid budget's answers on one split, through the serving engine (one pass per budget per text)."""

    budgets: tuple[float, ...]
    logits: np.ndarray  # (K, N, C)
    labels: np.ndarray  # (N,)
    lengths: np.ndarray  # (N,) tokens
    costs: np.ndarray  # (K, N) one pass's whole-forward share at each text's length
    macs: np.ndarray  # (K, N) int64: the same in multiply-adds (what the engine's ceiling compares)
    features: np.ndarray  # (N, F) the predictor's features

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def correct(self) -> np.ndarray:
        """(K, N) bool: the answer at each budget is right."""
        return self.logits.argmax(axis=2) == self.labels[None, :]  # type: ignore[no-any-return]

    @property
    def confidence(self) -> np.ndarray:
        """(K, N) the max softmax probability at each budget."""
        z = self.logits.astype(np.float64)
        e = np.exp(z - z.max(axis=2, keepdims=True))
        return e.max(axis=2) / e.sum(axis=2)  # type: ignore[no-any-return]

    def take(self, idx: np.ndarray) -> Passes:
        return Passes(self.budgets, self.logits[:, idx], self.labels[idx], self.lengths[idx], self.costs[:, idx],
                      self.macs[:, idx], self.features[idx])

    def target_cost(self, target: float) -> float:
        """Mean cost of running every text at the fixed budget ``target``."""
        return float(self.costs[self.budgets.index(_on_grid(target))].mean())


def _on_grid(b: float) -> float:
    return min(BUDGET_GRID, key=lambda g: abs(g - b))


def collect(engine: EngineBase, split: Split, batch_size: int = 32, progress: bool = True) -> Passes:
    """Run every grid budget over ``split`` (length-sorted batches, the engine's own tokenization)."""
    enc = engine.encoder.encode(split.texts)
    lengths = np.asarray([len(r) for r in enc.ids], dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    logits = np.zeros((len(BUDGET_GRID), len(split), len(engine.cfg.labels)), dtype=np.float32)
    for k, b in enumerate(BUDGET_GRID):
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = int(lengths[idx].max())
            ids = np.full((len(idx), width), engine.encoder.pad_id, dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int32)
            for row, i in enumerate(idx):
                ids[row, :lengths[i]], mask[row, :lengths[i]] = enc.ids[i], 1
            logits[k, idx] = engine.predict_ids(ids, mask, b)
        if progress:
            log.info("decider data: b=%.2f accuracy %.4f", b,
                     float((logits[k].argmax(1) == np.asarray(split.labels)).mean()))
    cost = [[engine.pass_cost(b, int(n)) for n in lengths] for b in BUDGET_GRID]
    return Passes(BUDGET_GRID, logits, np.asarray(split.labels, dtype=np.int64), lengths,
                  np.asarray([[c.ratio for c in row] for row in cost]),
                  np.asarray([[c.total_macs for c in row] for row in cost], dtype=np.int64), engine.features(enc.ids))


# -- cascade --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidates:
    """Operating points on a split: mean cost, accuracy, and the setting behind each."""

    cost: np.ndarray  # (M,)
    accuracy: np.ndarray  # (M,)
    settings: Sequence[Point]  # target/mean_cost/accuracy filled in on choice

    def best(self, budget: float) -> int | None:
        """The most accurate candidate within mean cost ``budget`` (the cheaper on a tie), or None."""
        ok = np.flatnonzero(self.cost <= budget + 1e-12)
        if ok.size == 0:
            return None
        top = self.accuracy[ok].max()
        tied = ok[self.accuracy[ok] >= top - 1e-12]
        return int(tied[np.argmin(self.cost[tied])])


def cascade_candidates(p: Passes, cap_only: bool = False) -> Candidates:
    """Every two-stage cascade (and every fixed budget) on ``p``, run as the engine runs it under a ceiling of
    1.0: a text escalates to the highest budget up to the stage that its cheap pass leaves room for (both passes
    together at most one dense pass, engine/decider.py), or not at all."""
    right, conf = p.correct, p.confidence
    cols = np.arange(len(p))
    top = len(p.budgets) - 1
    costs, accs, settings = [], [], []
    for k, b in enumerate(p.budgets):  # one stage: a fixed budget
        costs.append(p.costs[k].mean())
        accs.append(right[k].mean())
        settings.append(CascadePoint(0.0, 0.0, 0.0, stages=(b,)))
    for lo in range(top):
        # Thresholds halfway between quantiles of the cheap pass's confidence (never on a text's own value, so
        # that the last bit of a pass computed in another batch cannot flip a decision), and 1+: all escalate.
        qs = np.unique(np.quantile(conf[lo], np.linspace(0.0, 1.0, N_THRESHOLDS)))
        ts = np.concatenate([(qs[:-1] + qs[1:]) / 2, [1.0 + 1e-9]])
        # per text, the highest budget index that fits after the cheap pass (lo itself: none fits)
        fits = p.macs[lo][None, :] + p.macs <= p.macs[top][None, :]  # (K, N), a prefix of the budgets
        room = np.maximum(np.where(fits.any(axis=0), fits.sum(axis=0) - 1, lo), lo)
        for hi in [top] if cap_only else range(lo + 1, len(p.budgets)):
            eff = np.minimum(room, hi)  # (N,)
            esc = (conf[lo][None, :] < ts[:, None]) & (eff > lo)[None, :]  # (T, N)
            cost = p.costs[lo][None, :] + esc * p.costs[eff, cols][None, :]
            ok = np.where(esc, right[eff, cols][None, :], right[lo][None, :])
            costs.extend(cost.mean(axis=1).tolist())
            accs.extend(ok.mean(axis=1).tolist())
            settings.extend(CascadePoint(0.0, 0.0, 0.0, stages=(p.budgets[lo], p.budgets[hi]),
                                         thresholds=(float(t),)) for t in ts)
    return Candidates(np.asarray(costs), np.asarray(accs), settings)


def _points(cands: Candidates, p: Passes, targets: Sequence[float]) -> list[Point]:
    """The best candidate per target; a target whose best is an earlier target's setting adds no point."""
    points: list[Point] = []
    for t in sorted(targets):
        i = cands.best(p.target_cost(t))
        if i is None:
            continue
        s = cands.settings[i]  # its target, cost and accuracy are 0: equal to a point's setting alone
        if any(replace(q, target=0.0, mean_cost=0.0, accuracy=0.0) == s for q in points):
            continue
        points.append(replace(s, target=float(t), mean_cost=float(cands.cost[i]), accuracy=float(cands.accuracy[i])))
    return points


def _default(points: Sequence[Point], full_accuracy: float, tolerance: float,
             default_target: float | None) -> int:
    if default_target is not None:
        return min(range(len(points)), key=lambda i: (abs(points[i].target - default_target), points[i].target))
    good = [i for i, pt in enumerate(points) if pt.accuracy >= full_accuracy - tolerance]
    if good:
        return min(good, key=lambda i: (points[i].mean_cost, -points[i].accuracy))
    return max(range(len(points)), key=lambda i: (points[i].accuracy, -points[i].mean_cost))


def fit_cascade(p: Passes, checksum: str, labels: Sequence[str], targets: Sequence[float] = TARGETS,
                tolerance: float = TOLERANCE, default_target: float | None = None) -> Decider:
    """The cascade's operating points on ``p`` (the validation split)."""
    points = _points(cascade_candidates(p), p, targets)
    if not points:
        raise ValueError(f"no cascade fits any of the targets {list(targets)}")
    cap = cascade_candidates(p, cap_only=True)
    cap_only = {str(pt.target): round(float(cap.accuracy[i]), 6)
                for pt in points if (i := cap.best(p.target_cost(pt.target))) is not None}
    full = float(p.correct[-1].mean())
    meta = {"n_calibration": len(p), "accuracy_at_1.0": full, "cap_only": cap_only}
    return Decider(DeciderKind.CASCADE, tuple(points), _default(points, full, tolerance, default_target), checksum,
                   tuple(labels), meta=meta)


# -- predictor ------------------------------------------------------------------------------------------------
def smallest_right(p: Passes) -> np.ndarray:
    """(N,) per text the index of the smallest budget from which every larger budget's answer is right too;
    0 for texts wrong at the largest (no budget buys them a right answer: spend the least)."""
    right = p.correct  # (K, N)
    suffix = np.flip(np.cumprod(np.flip(right, axis=0), axis=0), axis=0).astype(bool)  # right at k and above
    k = len(p.budgets)
    first = np.where(suffix.any(axis=0), np.argmax(suffix, axis=0), 0)
    return np.where(right[k - 1], first, 0)  # type: ignore[no-any-return]


def _fit_softmax(x: np.ndarray, y: np.ndarray, n_classes: int, l2: float) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression with an L2 penalty on the weights (not the bias): (W (F, K), b (K,))."""
    from scipy.optimize import minimize

    n, f = x.shape
    onehot = np.eye(n_classes)[y]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[: f * n_classes].reshape(f, n_classes), theta[f * n_classes:]
        z = x @ w + b
        z -= z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        g = (np.exp(logp) - onehot) / n
        value = -float((onehot * logp).sum()) / n + 0.5 * l2 * float((w * w).sum())
        return value, np.concatenate([(x.T @ g + l2 * w).ravel(), g.sum(axis=0)])

    res = minimize(loss, np.zeros(f * n_classes + n_classes), jac=True, method="L-BFGS-B",
                   options={"maxiter": 500})
    return res.x[: f * n_classes].reshape(f, n_classes), res.x[f * n_classes:]


def fit_predictor(p: Passes, checksum: str, labels: Sequence[str], targets: Sequence[float] = TARGETS,
                  tolerance: float = TOLERANCE, default_target: float | None = None, seed: int = 0) -> Decider:
    """The predictor: regression on one half of ``p``, its thresholds per target on the other half."""
    perm = np.random.default_rng(seed).permutation(len(p))
    fit, cal = p.take(perm[: len(p) // 2]), p.take(perm[len(p) // 2:])
    y_fit, y_cal = smallest_right(fit), smallest_right(cal)
    mean, scale = fit.features.mean(axis=0), fit.features.std(axis=0)
    scale = np.where(scale > 1e-6, scale, 1.0)
    k = len(p.budgets)
    best: tuple[float, float, Predictor] | None = None
    for l2 in L2_GRID:  # the penalty with the best held-out likelihood
        w, b = _fit_softmax((fit.features - mean) / scale, y_fit, k, l2)
        pred = Predictor(p.budgets, mean, scale, w, b)
        nll = -float(np.log(pred.level_probs(cal.features)[np.arange(len(cal)), y_cal] + 1e-12).mean())
        if best is None or nll < best[0]:
            best = (nll, l2, pred)
    assert best is not None
    nll, l2, pred = best
    right = cal.correct
    costs, accs, settings = [], [], []
    index = {b: i for i, b in enumerate(p.budgets)}
    for tau in TAUS:
        level = np.asarray([index[float(b)] for b in pred.choose(cal.features, tau)])
        cols = np.arange(len(cal))
        costs.append(cal.costs[level, cols].mean())
        accs.append(right[level, cols].mean())
        settings.append(PredictorPoint(0.0, 0.0, 0.0, tau=float(tau)))
    points = _points(Candidates(np.asarray(costs), np.asarray(accs), settings), cal, targets)
    if not points:
        raise ValueError(f"no predictor threshold fits any of the targets {list(targets)}")
    full = float(right[-1].mean())
    meta = {"n_fit": len(fit), "n_calibration": len(cal), "l2": l2, "heldout_nll": nll, "accuracy_at_1.0": full,
            "label_histogram": np.bincount(y_fit, minlength=k).tolist()}
    return Decider(DeciderKind.PREDICTOR, tuple(points), _default(points, full, tolerance, default_target), checksum,
                   tuple(labels), predictor=pred, meta=meta)


def simulate(decider: Decider, point: Point, p: Passes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ``Engine.run(texts, Auto(1.0, point.target))`` does on ``p``'s texts, from its cached answers (the same
    rules as engine/decider.py ``run_auto``): per text (cost, right, passes)."""
    index = {b: k for k, b in enumerate(p.budgets)}
    right, conf = p.correct, p.confidence
    top = len(p.budgets) - 1
    cost, ok, n_passes = np.zeros(len(p)), np.zeros(len(p), dtype=bool), np.zeros(len(p), dtype=np.int64)
    if isinstance(point, PredictorPoint):
        assert decider.predictor is not None
        level = np.asarray([index[float(b)] for b in decider.predictor.choose(p.features, point.tau)])
        cols = np.arange(len(p))
        return p.costs[level, cols], right[level, cols], np.ones(len(p), dtype=np.int64)
    for i in range(len(p)):
        k, spent, s = index[point.stages[0]], 0, 0
        while True:
            cost[i] += p.costs[k, i]
            spent += int(p.macs[k, i])
            n_passes[i] += 1
            if s >= len(point.thresholds) or conf[k, i] >= point.thresholds[s]:
                break
            want = index[point.stages[s + 1]]
            fits = [j for j in range(k + 1, want + 1) if spent + p.macs[j, i] <= p.macs[top, i]]
            if not fits:
                break
            k, s = max(fits), s + 1
        ok[i] = right[k, i]
    return cost, ok, n_passes


Fit = Callable[[Passes, str, Sequence[str], Sequence[float], float, float | None], Decider]
_FIT: dict[DeciderKind, Fit] = {DeciderKind.CASCADE: fit_cascade, DeciderKind.PREDICTOR: fit_predictor}


def fit(kind: DeciderKind, p: Passes, checksum: str, labels: Sequence[str], targets: Sequence[float] = TARGETS,
        tolerance: float = TOLERANCE, default_target: float | None = None) -> Decider:
    """A decider of ``kind`` calibrated on ``p``."""
    return _FIT[DeciderKind(kind)](p, checksum, labels, targets, tolerance, default_target)


__all__ = ["DEFAULT_KIND", "TARGETS", "Passes", "collect", "fit", "fit_cascade", "fit_predictor", "simulate",
           "smallest_right"]
