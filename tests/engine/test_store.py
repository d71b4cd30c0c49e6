"""The typed weight store: its names, its round trip through the on-disk cache, and the precision table."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from headbudget.engine.artifacts import checkpoint_config
from headbudget.engine.onnx.cache import GraphCache
from headbudget.engine.precision import PRECISIONS
from headbudget.engine.types import Precision
from headbudget.engine.weights.pack import gate_params, load_state, pack
from headbudget.engine.weights.store import LayerNames, WeightStore, input_names, layer_names
from headbudget.models.budget import head_order
from headbudget.models.plan import BudgetPolicy


def test_every_precision_has_one_row_in_the_table() -> None:
    assert tuple(PRECISIONS) == get_args(Precision)


def _store(folder: Path, precision: Precision) -> tuple[WeightStore, np.ndarray]:
    _, cfg = checkpoint_config(folder)
    state = load_state(folder, cfg)
    order = head_order(gate_params(state))
    return pack(state, cfg, BudgetPolicy(cfg, order), precision), order


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("scope", ["attention", "model"])
def test_the_cache_gives_back_the_same_store(tiny_checkpoint: Path, tiny_model_scope_checkpoint: Path,
                                              tmp_path: Path, precision: Precision, scope: str) -> None:
    """arrays() names every array once; from_arrays rebuilds the records from them without a copy, and the
    graph cache's file holds the same bytes under the same names."""
    folder = tiny_checkpoint if scope == "attention" else tiny_model_scope_checkpoint
    _, cfg = checkpoint_config(folder)
    store, order = _store(folder, precision)
    arrays = store.arrays()
    again = WeightStore.from_arrays(arrays, cfg, precision).arrays()
    assert again.keys() == arrays.keys() and all(again[n] is arrays[n] for n in arrays)
    assert (store.w1_z is not None) == (precision == "int8" and scope == "model")
    assert all((lw.wqkv_s is not None) == PRECISIONS[precision].quantized for lw in store.layers)
    cache = GraphCache(tmp_path, "k", "test")
    cache.save_store(store, order, {})
    loaded = cache.load_store(cfg, precision)
    assert loaded is not None
    disk, disk_order = loaded[0].arrays(), loaded[1]
    assert np.array_equal(disk_order, order) and disk.keys() == arrays.keys()
    for n, a in arrays.items():
        assert disk[n].dtype == a.dtype and disk[n].shape == a.shape and disk[n].tobytes() == a.tobytes(), n


def test_names_are_distinct_and_slices_keep_their_layer() -> None:
    full, sliced = layer_names(1), layer_names(1, heads=3, neurons=64)
    names = [getattr(full, f.name) for f in fields(LayerNames)]
    assert len(set(names)) == len(names) and all(n.startswith("l1.") for n in names if n != full.w1_z)
    assert sliced.wqkv == full.wqkv + ".k3" and sliced.w1 == full.w1 + ".n64" and sliced.bo == full.bo
    assert sliced.w1_z == full.w1_z + ".n64" and layer_names(0).bo != full.bo
    inputs = input_names(1)
    per_call = [getattr(inputs, f.name) for f in fields(inputs)]
    assert len(set(per_call)) == len(per_call) and inputs.wqkv == full.wqkv and inputs.w1 != full.w1
