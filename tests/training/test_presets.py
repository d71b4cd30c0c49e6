"""Named presets resolve, through the command line's own parsing, to exactly the run they name.

`--recipe release` is the checkpoint behind the README's headline. Its own config.json is not committed; what is:
its sweep (docs/results/ag_news/model/sweep.json: the gate settings) and the config of the attention-scope run
trained with the same recipe for the baselines (docs/results/ag_news/attention-kept-recipe/config.json: every
recipe field, base, seed and data). Every field is compared with those files, so a preset that drifts from them
fails here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from headbudget.cli import build_parser
from headbudget.commands.train import resolve
from headbudget.models.config import GateConfig
from headbudget.training.recipes import LATER_FIELDS, PRESETS, RECIPE_NAMES, RUN_PRESETS, RunConfig

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "ag_news"
KEPT_SWEEP = RESULTS / "model" / "sweep.json"
KEPT_RECIPE_CONFIG = RESULTS / "attention-kept-recipe" / "config.json"
# The kept checkpoint's command as docs/results.md records it (device aside: where it ran is not what it is).
KEPT_COMMAND = ("--base minilm --data ag_news --recipe full --scope model --seed 7 --exits 3 "
                "--set length_buckets=true --set hard_teacher=dense --set hard_epochs=10 --set sandwich=true "
                "--set fused_sandwich=true")


def resolved(*flags: str) -> RunConfig:
    """What `headbudget train FLAGS` would train, from the real parser, without training."""
    args = build_parser().parse_args(["train", "--out", "unused", *flags])
    return resolve(args)


def recorded_exits(sweep: dict[str, Any]) -> tuple[int, ...]:
    """The sweep's exits; a sweep written before it recorded them shows them as the depths its budgets stop at."""
    if "exits" in sweep:
        return tuple(sweep["exits"])
    return tuple(sorted({p["layers_run"] for p in sweep["points"]} - {sweep["n_layers"]}))


def test_release_is_the_kept_checkpoints_recipe_field_by_field() -> None:
    run = resolved("--data", "ag_news", "--recipe", "release")
    record = json.loads(KEPT_RECIPE_CONFIG.read_text())
    ours = run.recipe.to_dict()
    # A field added after the record was written is absent from it: it must sit at its identity-neutral default.
    theirs = {**{k: v for k, v in LATER_FIELDS.items() if k not in record["recipe"]}, **record["recipe"]}
    assert set(ours) == set(theirs)
    differ = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert not differ, f"release differs from {KEPT_RECIPE_CONFIG.name}: {differ}"
    assert (run.base, run.seed, run.data) == (record["base"], record["seed"], record["data"]["spec"])
    assert (run.model_type, run.text_column, run.label_column) == (
        record["model_type"], record["data"]["text_column"], record["data"]["label_column"])


def test_release_has_the_kept_checkpoints_gate_settings() -> None:
    run = resolved("--data", "ag_news", "--recipe", "release")
    sweep = json.loads(KEPT_SWEEP.read_text())
    gate = GateConfig(structural=run.structural, scope=run.scope, exits=run.exits)
    assert gate.scope == sweep["scope"] == "model"
    assert gate.structural is sweep["structural"] is False
    assert (gate.ffn_group, gate.ref_length) == (sweep["ffn_group"], sweep["ref_length"])
    assert gate.exits == recorded_exits(sweep) == (3,)
    # The attention-scope sibling differs in its gate only: scope, and no exits.
    sibling = json.loads(KEPT_RECIPE_CONFIG.read_text())["model"]["gate"]
    assert asdict(replace(gate, scope="attention", exits=())) == {**sibling, "exits": ()}


def test_release_is_the_documented_command() -> None:
    assert resolved("--data", "ag_news", "--recipe", "release") == resolved(*KEPT_COMMAND.split())
    assert resolved("--data", "ag_news", "--recipe", "release").identity() == resolved(*KEPT_COMMAND.split()).identity()


@pytest.mark.parametrize("name", list(PRESETS))
def test_plain_recipes_resolve_as_before_but_for_the_scope(name: str) -> None:
    run = resolved("--data", "synthetic", "--recipe", name)
    assert run.recipe == PRESETS[name] and run.scope == "model" and run.exits == ()
    attention = resolved("--data", "synthetic", "--recipe", name, "--scope", "attention")
    # What an attention run was before the default changed, identity included (its run folders still resume).
    before = RunConfig(base="minilm", data="synthetic", recipe=PRESETS[name])
    assert attention == before and attention.identity() == before.identity() and "scope" not in before.identity()


def test_flags_override_a_presets_gate_settings() -> None:
    assert resolved("--data", "x", "--recipe", "release", "--exits", "2").exits == (2,)
    assert resolved("--data", "x", "--recipe", "release", "--exits", "").exits == ()
    # Attention scope takes none of the preset's exits, which need the whole-model scope.
    attention = resolved("--data", "x", "--recipe", "release", "--scope", "attention")
    assert (attention.scope, attention.exits) == ("attention", ())
    assert resolved("--data", "x", "--recipe", "release", "--set", "hard_epochs=6").recipe.hard_epochs == 6
    # The adaptive types and --structural budget attention only: their default scope is that.
    assert resolved("--data", "x", "--model", "span").scope == "attention"
    assert resolved("--data", "x", "--structural").scope == "attention"


def test_every_name_the_command_offers_is_a_preset() -> None:
    assert set(RECIPE_NAMES) == set(PRESETS) | set(RUN_PRESETS) and not set(PRESETS) & set(RUN_PRESETS)
    for name in RUN_PRESETS:  # a run preset keeps the recipe name it was trained under: same identity, same folder
        assert RUN_PRESETS[name].recipe.name in PRESETS
