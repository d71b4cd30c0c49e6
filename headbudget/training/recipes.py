"""Training recipes: frozen presets for the three stages of docs/method.md §6."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from types import MappingProxyType
from typing import Any, get_args, get_type_hints

from headbudget.models.config import Scope

HARD_TEACHERS = ("soft", "dense")
# Fields added after runs were published: at their defaults they stay out of a run's identity, so those
# run folders still resume.
LATER_FIELDS = {"hard_teacher": "soft", "hidden_distill": 0.0, "sandwich": False, "fused_sandwich": False,
                "exit_lr": 1e-3}


@dataclass(frozen=True)
class Recipe:
    """Everything a training run needs besides the base model and the data; saved with the checkpoint."""

    name: str
    dense_epochs: float  # stage 1: dense warm start (gates off); the published key to stable budgeted training
    budget_epochs: float  # stage 2: soft gates, b ~ U[b_min, 1] per batch
    hard_epochs: float = 1.0  # stage 3: one epoch of hard top-k with straight-through + distillation
    adapt_epochs: float = 2.0  # adaptive model types: their own stage after the dense warm start
    # Learning rate of the parameters an adaptive type adds (None = the type's default in training/stages.py).
    adaptive_lr: float | None = None
    examples_per_stage: int | None = None  # cap on training examples per stage (None = all)
    batch_size: int = 32
    max_length: int = 128
    lr: float = 5e-5  # encoder and classifier (AdamW, linear warm-up then decay)
    # Gates need to move several logits within one stage; with lr 5e-5 they would barely move.
    gate_lr: float = 5e-2
    weight_decay: float = 0.01
    warmup_fraction: float = 0.06
    b_min: float = 0.1
    lambda_cost: float = 0.1  # weight of C(b): prefer cheaper gates when the loss allows it
    lambda_violation: float = 10.0  # weight of max(0, C(b) - b)^2: keep the soft cost under the budget
    distill_alpha: float = 0.5  # stage 3: alpha * CE + (1 - alpha) * T^2 * KL
    distill_temperature: float = 2.0
    # Stage 3's teacher: "soft" (docs/method.md §6.3: the frozen stage-2 model at the same budget) or "dense"
    # (the stage-1 model, every unit on, as DynaBERT distils every width from the full fine-tuned model).
    hard_teacher: str = "soft"
    # Weight of the mean-squared error between the student's and the teacher's hidden states after every
    # layer, added to the stage-3 loss (DynaBERT's hidden-state distillation; 0 = logits only).
    hidden_distill: float = 0.0
    # Stages 2 and 3 train each batch at b = 1, at b = b_min and at one random budget, and average the three
    # losses (the "sandwich rule" of slimmable networks, Yu and Huang 2019): the extremes of a shared-weight
    # family see every batch, where one random budget per batch visits them rarely.
    sandwich: bool = False
    # Run the sandwich's budgets as one forward pass over the batch repeated per budget (each copy with its own
    # gates) instead of one pass per budget: the same loss (checked in tests, eval mode), a third of the kernel
    # launches, which is what bounds MiniLM's small batches on a GPU. Dropout draws differ, so a run with it is
    # a new run, not a replay of one without.
    fused_sandwich: bool = False
    # Learning rate of the exit heads (checkpoints with exits), which start stage 3 as copies of the classifier
    # and must move to read a lower layer within it: at the encoder's 5e-5 a linear head barely moves.
    exit_lr: float = 1e-3
    # Word embeddings stay frozen: they are half of MiniLM's parameters, the data sets are small (10k rows
    # for AG News), and freezing them keeps fine-tuning from drifting rare-token rows it barely sees.
    freeze_embeddings: bool = True
    val_examples: int | None = None  # validation subset used for checkpoint selection (None = all)
    val_budgets: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 1.0)  # selection metric: mean accuracy over these
    evals_per_epoch: int = 1
    synthetic_size: int = 4000  # training rows of the synthetic task
    # Batches of similar-length texts (less padding, faster steps). Off for `full`, whose published numbers
    # were trained without it and must reproduce exactly.
    length_buckets: bool = False
    sweep_examples: int | None = None  # test examples in the sweep written at the end of training (None = all)

    def __post_init__(self) -> None:
        if self.hard_teacher not in HARD_TEACHERS:
            raise ValueError(f"hard_teacher must be one of {', '.join(HARD_TEACHERS)}, got {self.hard_teacher!r}")
        if self.hidden_distill < 0:
            raise ValueError(f"hidden_distill must be >= 0, got {self.hidden_distill}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["val_budgets"] = list(self.val_budgets)
        return d


PRESETS: dict[str, Recipe] = {
    # Tiny base on the synthetic task: the end-to-end test of the whole pipeline, well under a minute.
    "smoke": Recipe(
        name="smoke", dense_epochs=8, budget_epochs=3, hard_epochs=1, batch_size=32, max_length=32,
        lr=1e-3, gate_lr=5e-2, warmup_fraction=0.05, val_budgets=(0.25, 0.5, 1.0), synthetic_size=3000,
        sweep_examples=500,
    ),
    # MiniLM on ~2,000 examples a stage: a usable checkpoint in minutes on 2 cores.
    "quick": Recipe(
        name="quick", dense_epochs=1, budget_epochs=1, hard_epochs=1, examples_per_stage=2000, batch_size=16,
        sweep_examples=300, length_buckets=True,
        max_length=128, lr=1e-4, gate_lr=1e-1, val_examples=300, val_budgets=(0.25, 0.5, 1.0),
    ),
    # All training data: the numbers in docs/results.md come from this one.
    "full": Recipe(
        name="full", dense_epochs=3, budget_epochs=3, hard_epochs=1, batch_size=32, max_length=128,
        lr=5e-5, gate_lr=5e-2, evals_per_epoch=2,
    ),
}


@dataclass(frozen=True)
class RunPreset:
    """A recipe together with the gate settings it is trained with; ``headbudget train`` flags override them."""

    recipe: Recipe
    scope: str = "model"  # what a budget spans (GateConfig.scope): the whole model unless a flag says otherwise
    exits: tuple[int, ...] = ()  # layer skipping: depths with an exit head (GateConfig.exits)


# Named configurations of published checkpoints: one name reproduces one exactly. The recipe keeps the name of the
# recipe it was trained from ("full" plus --set overrides), so a run of the preset has the identity, and resumes
# the run folders, of the run it names.
RUN_PRESETS: dict[str, RunPreset] = {
    # The checkpoint behind the README's headline (AG News, MiniLM, seed 7); tests/training/test_presets.py
    # checks every field against its committed record.
    "release": RunPreset(
        recipe=replace(PRESETS["full"], length_buckets=True, hard_teacher="dense", hard_epochs=10.0, sandwich=True,
                       fused_sandwich=True),
        scope="model", exits=(3,),
    ),
}
RECIPE_NAMES: tuple[str, ...] = (*PRESETS, *RUN_PRESETS)


def get_preset(name: str) -> RunPreset:
    """A recipe name's preset: a run preset as it is, a plain recipe with the default gate settings."""
    if name in RUN_PRESETS:
        return RUN_PRESETS[name]
    if name in PRESETS:
        return RunPreset(PRESETS[name])
    raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPE_NAMES)}")


def get_recipe(name: str, **overrides: Any) -> Recipe:
    """A preset's recipe by name, with optional field overrides."""
    return replace(get_preset(name).recipe, **overrides)


# Fields run.json gained later (the adaptive types, the whole-model scope, layer skipping), left out at the value
# they had before, so that run folders written before them still resume.
_ADDED_LATER: dict[str, Any] = {"model_type": "budgeted", "scope": "attention", "exits": []}


@dataclass(frozen=True)
class RunConfig:
    """The resolved inputs of a run; a resumed run must match them exactly. Torch-free, so that the CLI refuses a
    bad flag before the training stack loads."""

    base: str
    data: str
    recipe: Recipe
    seed: int = 7
    structural: bool = False
    text_column: str = "text"
    label_column: str = "label"
    device: str = "cpu"
    model_type: str = "budgeted"  # or an adaptive type: dense warm start, then its own "adapt" stage
    scope: Scope = "attention"  # what a budget spans: the heads, or the whole model (GateConfig.scope)
    exits: tuple[int, ...] = ()  # layer skipping: depths with an exit head (GateConfig.exits)

    def identity(self) -> dict[str, Any]:
        d = asdict(self)
        d["recipe"] = {k: v for k, v in self.recipe.to_dict().items()
                       if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
        d.pop("device")  # where it ran does not change what it is
        d["exits"] = list(d["exits"])
        for name, value in _ADDED_LATER.items():
            if d[name] == value:
                d.pop(name)
        return d


def _parse_bool(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(value)
    return value.lower() in ("true", "1")


def _parse_floats(value: str) -> tuple[float, ...]:
    return tuple(float(v) for v in value.split(",") if v.strip())


# How a --set value becomes each type a Recipe field holds (an optional field also takes "none").
_PARSERS: Mapping[object, Callable[[str], Any]] = MappingProxyType({
    str: str, int: int, float: float, bool: _parse_bool, tuple[float, ...]: _parse_floats,
})


def _field_type(hint: object) -> tuple[object, bool]:
    """A field's type without None, and whether None is allowed: ``int | None`` -> (int, True)."""
    args = get_args(hint)
    if type(None) not in args:
        return hint, False
    (inner,) = (a for a in args if a is not type(None))
    return inner, True


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> typed Recipe field overrides; unknown keys and bad values raise ValueError."""
    hints = get_type_hints(Recipe)
    written = {f.name: str(f.type) for f in fields(Recipe)}  # as the class spells them, for the message
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in hints or key == "name":
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(k for k in hints if k != 'name')}")
        kind, optional = _field_type(hints[key])
        try:
            out[key] = None if optional and value.lower() == "none" else _PARSERS[kind](value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {value!r} is not a valid {written[key]}") from None
    return out
