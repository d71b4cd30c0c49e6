"""``budget=auto`` on a budgeted checkpoint: a decider, saved beside the weights as ``decider.json``, picks each
text's budget.

Two kinds (docs/method.md, '8. `budget=auto`'), each with operating points calibrated on the validation split by
training/decider.py: a cascade escalates a text from a cheap pass while its answer's confidence is below a
threshold; a predictor picks one level per text from features of the embedding layer. A ceiling bounds every text:
the multiply-adds of its passes never exceed one pass at the ceiling, at its own length.

Torch-free (numpy only): the ONNX Runtime serving process loads it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from headbudget.engine.names import DEFAULT_KIND as DEFAULT_KIND  # re-exported: the decider's own names
from headbudget.engine.names import DeciderKind as DeciderKind
from headbudget.models.budget import BUDGET_GRID
from headbudget.models.plan import Cost

log = logging.getLogger(__name__)

DECIDER_FILE = "decider.json"
FORMAT = 1
KINDS: tuple[DeciderKind, ...] = tuple(DeciderKind)


class DeciderError(ValueError):
    """A decider.json that cannot be used (malformed, or made for other weights)."""


@dataclass(frozen=True)
class Calibrated:
    """What an operating point aims at and reached on the calibration split (either kind)."""

    target: float  # the mean cost (whole-forward share, all passes) it was calibrated not to exceed
    mean_cost: float  # its mean cost on the calibration split
    accuracy: float  # its accuracy there

    def _reached(self) -> dict[str, Any]:
        return {"target": self.target, "mean_cost": self.mean_cost, "accuracy": self.accuracy}


@dataclass(frozen=True)
class CascadePoint(Calibrated):
    """A cascade's setting: run ``stages[0]``, escalate from ``stages[i]`` when the max probability is below
    ``thresholds[i]``."""

    stages: tuple[float, ...] = ()  # the budgets, cheapest first
    thresholds: tuple[float, ...] = ()  # one fewer than the stages

    def to_dict(self) -> dict[str, Any]:
        return {**self._reached(), "stages": list(self.stages), "thresholds": list(self.thresholds)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CascadePoint:
        stages = tuple(float(b) for b in d.get("stages", ()))
        thresholds = tuple(float(t) for t in d.get("thresholds", ()))
        if not stages or len(thresholds) != len(stages) - 1:
            raise DeciderError("a cascade point needs stages and one threshold fewer")
        if list(stages) != sorted(set(stages)) or not all(0.0 < b <= 1.0 for b in stages):
            raise DeciderError(f"cascade stages must be increasing budgets in (0, 1], got {stages}")
        return cls(float(d["target"]), float(d["mean_cost"]), float(d["accuracy"]), stages, thresholds)


@dataclass(frozen=True)
class PredictorPoint(Calibrated):
    """A predictor's setting: run the smallest level whose cumulative probability is >= ``tau``."""

    tau: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**self._reached(), "tau": self.tau}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PredictorPoint:
        tau = float(d.get("tau", 0.0))
        if not 0.0 <= tau <= 1.0:
            raise DeciderError(f"tau must be in [0, 1], got {tau}")
        return cls(float(d["target"]), float(d["mean_cost"]), float(d["accuracy"]), tau)


Point = CascadePoint | PredictorPoint
_POINTS: dict[DeciderKind, type[CascadePoint] | type[PredictorPoint]] = {
    DeciderKind.CASCADE: CascadePoint, DeciderKind.PREDICTOR: PredictorPoint}


@dataclass(frozen=True, eq=False)
class Predictor:
    """Multinomial logistic regression: standardized features (F,) -> P(smallest right level = k), (K,)."""

    levels: tuple[float, ...]  # the budgets it chooses among, increasing
    mean: np.ndarray  # (F,)
    scale: np.ndarray  # (F,)
    weights: np.ndarray  # (F, K)
    bias: np.ndarray  # (K,)

    def level_probs(self, features: np.ndarray) -> np.ndarray:
        """(N, K) probabilities of each level being the smallest at which the answer is right."""
        z = ((features - self.mean) / self.scale) @ self.weights + self.bias
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]

    def choose(self, features: np.ndarray, tau: float) -> np.ndarray:
        """(N,) the level each text runs at: the smallest whose cumulative probability reaches ``tau``."""
        cum = np.cumsum(self.level_probs(features), axis=1)
        cum[:, -1] = 1.0  # the last level always qualifies (rounding)
        k = np.argmax(cum >= tau - 1e-12, axis=1)
        chosen: np.ndarray = np.asarray(self.levels, dtype=np.float64)[k]
        return chosen

    def to_dict(self) -> dict[str, Any]:
        return {"levels": list(self.levels), "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "weights": self.weights.tolist(), "bias": self.bias.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Predictor:
        levels = tuple(float(b) for b in d["levels"])
        mean, scale = np.asarray(d["mean"], dtype=np.float64), np.asarray(d["scale"], dtype=np.float64)
        weights, bias = np.asarray(d["weights"], dtype=np.float64), np.asarray(d["bias"], dtype=np.float64)
        f, k = mean.shape[0], len(levels)
        if scale.shape != (f,) or weights.shape != (f, k) or bias.shape != (k,) or not np.all(scale > 0):
            raise DeciderError(f"predictor arrays do not fit {f} features and {k} levels")
        if list(levels) != sorted(set(levels)) or not all(0.0 < b <= 1.0 for b in levels):
            raise DeciderError(f"predictor levels must be increasing budgets in (0, 1], got {levels}")
        return cls(levels, mean, scale, weights, bias)


@dataclass(frozen=True, eq=False)
class Decider:
    """A calibrated decider for one checkpoint (``checksum``): its kind, operating points and the default one."""

    kind: DeciderKind
    points: tuple[Point, ...]  # all of the kind's point type
    default: int  # index of the point `auto` alone runs at
    checksum: str  # sha256 of the model.safetensors it was calibrated on
    labels: tuple[str, ...]
    predictor: Predictor | None = None  # the predictor kind's regression
    meta: dict[str, Any] = field(default_factory=dict)  # how it was made (data, split, sizes), for people

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", DeciderKind(self.kind))  # a kind given by its name in the file

    @property
    def default_point(self) -> Point:
        return self.points[self.default]

    def point(self, target: float | None = None) -> Point:
        """The default point, or the one calibrated for the target nearest ``target`` (the cheaper on a tie)."""
        if target is None:
            return self.default_point
        return min(self.points, key=lambda p: (abs(p.target - target), p.target))

    def hot_budgets(self) -> tuple[float, ...]:
        """The budgets most auto passes run at: the default cascade point's stages (none for the predictor)."""
        point = self.default_point
        return point.stages if isinstance(point, CascadePoint) else ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT, "kind": self.kind.value, "checksum": self.checksum,
                             "labels": list(self.labels), "default": self.default,
                             "points": [p.to_dict() for p in self.points], "meta": self.meta}
        if self.predictor is not None:
            d["predictor"] = self.predictor.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Decider:
        """Parse and check a decider.json document (DeciderError naming what is wrong)."""
        try:
            if d.get("format") != FORMAT:
                raise DeciderError(f"format {d.get('format')!r}, this build reads {FORMAT}")
            if d["kind"] not in KINDS:
                raise DeciderError(f"kind {d['kind']!r}, expected one of {', '.join(KINDS)}")
            kind = DeciderKind(d["kind"])
            points = tuple(_POINTS[kind].from_dict(p) for p in d["points"])
            if not points:
                raise DeciderError("no operating points")
            default = int(d["default"])
            if not 0 <= default < len(points):
                raise DeciderError(f"default {default} is not one of the {len(points)} points")
            predictor = Predictor.from_dict(d["predictor"]) if kind is DeciderKind.PREDICTOR else None
            return cls(kind, points, default, str(d["checksum"]), tuple(str(x) for x in d["labels"]), predictor,
                       dict(d.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, DeciderError):
                raise
            raise DeciderError(f"malformed ({type(e).__name__}: {e})") from None


def save_decider(decider: Decider, folder: Path) -> Path:
    """Write ``decider.json`` into ``folder`` (the checkpoint's)."""
    path = Path(folder) / DECIDER_FILE
    path.write_text(json.dumps(decider.to_dict(), indent=1) + "\n")
    return path


def read_decider(folder: Path, checksum: str, labels: Sequence[str]) -> Decider | None:
    """The checkpoint's decider, if it has a usable one; one made for other weights or labels, or a malformed
    file, is ignored with a warning (the checkpoint then serves no auto, and says so with a 400)."""
    path = Path(folder) / DECIDER_FILE
    if not path.is_file():
        return None
    try:
        decider = Decider.from_dict(json.loads(path.read_text()))
        if decider.checksum != checksum:
            raise DeciderError("made for other weights (checksum differs); run `headbudget decider` again")
        if decider.labels != tuple(labels):
            raise DeciderError(f"made for labels {list(decider.labels)}, the checkpoint has {list(labels)}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, DeciderError) as e:
        log.warning("%s: ignored, budget=auto is off (%s)", path, e)
        return None
    return decider


# -- running auto ----------------------------------------------------------------------------------------------
RunPass = Callable[[float, list[int]], np.ndarray]  # (budget, text indices) -> logits (len, C)
PassMacs = Callable[[float, int], int]  # (budget, tokens) -> whole-forward multiply-adds of one pass


@dataclass
class TextRun:
    """One text's passes under auto, in order, and the logits of the last (its answer)."""

    passes: list[float] = field(default_factory=list)
    logits: np.ndarray | None = None


def ceiling_levels(ceiling: float) -> list[float]:
    """The budgets a text may run at under ``ceiling``: the grid's up to it, and the ceiling itself."""
    return sorted({b for b in BUDGET_GRID if b <= ceiling + 1e-9} | {ceiling})


def max_prob(logits: np.ndarray) -> float:
    z = logits.astype(np.float64)
    e = np.exp(z - z.max())
    return float(e.max() / e.sum())


def run_auto(decider: Decider, point: Point, ceiling: float, lengths: Sequence[int], run_pass: RunPass,
             pass_macs: PassMacs, features: np.ndarray | None = None) -> list[TextRun]:
    """Every text's passes under ``point`` within ``ceiling``; texts that run the same budget in a round share
    one ``run_pass`` call (a batch pads to its own longest text). ``features``: the predictor's, for its points."""
    runs = [TextRun() for _ in lengths]
    if isinstance(point, PredictorPoint):
        assert decider.predictor is not None and features is not None
        chosen = decider.predictor.choose(features, point.tau)
        _run_round({i: min(float(b), ceiling) for i, b in enumerate(chosen)}, runs, run_pass)
        return runs
    levels = ceiling_levels(ceiling)
    limit = [pass_macs(ceiling, n) for n in lengths]
    spent = [0] * len(lengths)
    stage = [0] * len(lengths)
    # Nested plans: a budget at or below the ceiling costs no more than the ceiling at any length.
    todo = {i: min(point.stages[0], ceiling) for i in range(len(lengths))}
    while todo:
        _run_round(todo, runs, run_pass)
        escalate: dict[int, float] = {}
        for i in todo:
            spent[i] += pass_macs(runs[i].passes[-1], lengths[i])
            s = stage[i]
            logits = runs[i].logits
            assert logits is not None
            if s >= len(point.thresholds) or max_prob(logits) >= point.thresholds[s]:
                continue
            current, want = runs[i].passes[-1], point.stages[s + 1]
            fits = [b for b in levels if current + 1e-9 < b <= want + 1e-9
                    and spent[i] + pass_macs(b, lengths[i]) <= limit[i]]
            if fits:
                escalate[i], stage[i] = max(fits), s + 1
        todo = escalate
    return runs


def _run_round(budgets: dict[int, float], runs: list[TextRun], run_pass: RunPass) -> None:
    """One pass for each text in ``budgets``, one ``run_pass`` call per distinct budget."""
    groups: dict[float, list[int]] = {}
    for i, b in budgets.items():
        groups.setdefault(b, []).append(i)
    for b in sorted(groups):
        idx = groups[b]
        logits = run_pass(b, idx)
        for row, i in enumerate(idx):
            runs[i].passes.append(b)
            runs[i].logits = logits[row]


def passes_cost(costs: Sequence[Cost]) -> Cost:
    """One text's cost over all its passes: multiply-adds summed, against one dense pass; the heads and neurons
    are those of the last pass (the one whose answer it got)."""
    last = costs[-1]
    return Cost(heads_active=last.heads_active, heads_total=last.heads_total,
                attention_macs=sum(c.attention_macs for c in costs), attention_macs_dense=last.attention_macs_dense,
                total_macs=sum(c.total_macs for c in costs), total_macs_dense=last.total_macs_dense,
                neurons_active=last.neurons_active, neurons_total=last.neurons_total)


def pooled_features(embedded: np.ndarray, n_tokens: int) -> np.ndarray:
    """The predictor's features for one text: the mean of its embedding-layer output (N, D) and log(length)."""
    return np.concatenate([embedded.mean(axis=0), [math.log(n_tokens)]]).astype(np.float64)
