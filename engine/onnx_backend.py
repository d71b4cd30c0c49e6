"""ONNX Runtime backend: head-sliced graphs over one shared copy of the weights, one intra-op thread.

Memory: every session receives its weights through ``SessionOptions.add_initializer`` as OrtValues over
numpy views of one weight store (a budget's heads are a row prefix per layer, see weights.py), so sessions
add graph structure, not weights. All sessions draw activations from one process-wide arena.

Prepacking (``EngineOptions.prepack``) trades memory for speed, measured on MiniLM-L6, one thread:
- prepack on, one whole-model graph per budget: every session keeps its own packed copy of every matrix
  (the FFN's included): ~1 GB for the 19 budgets against ~136 MB for a dense session. Not offered.
- prepack off, one whole-model graph per budget ("whole" layout): ~0.9x the dense session's memory, but
  MLAS packs B on every call: 10-25% slower in fp32 at 48-128 tokens, up to 50% slower in int8 at 48.
- prepack on, per-layer pieces chained in Python ("chain" layout, the default): one prepacked FFN per
  layer shared by all budgets (2/3 of the multiply-adds at b = 1), attention pieces per distinct (layer,
  heads) pair left unpacked (``prepack_attention`` packs them too: one packed copy per pair, ~1.85x the
  dense session's memory on MiniLM), embeddings and head shared. Costs ~14 session calls per forward
  (a few us each through the C-level ``run_with_ort_values``). The default, because latency is what a
  budget sells and the memory stays under the 1.5x limit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from headbudget.engine import onnx_graph as G
from headbudget.engine.base import EngineBase
from headbudget.engine.errors import ModelLoadError
from headbudget.engine.graph_cache import GraphCache, cache_key
from headbudget.engine.types import EngineOptions, ModelInfo
from headbudget.engine.weights import (
    Arrays,
    HeadPlan,
    checkpoint_config,
    gate_params,
    load_state,
    pack,
)
from headbudget.models.budget import BUDGET_GRID, head_order

log = logging.getLogger(__name__)
_ENV_ARENA = False


def _shared_arena() -> None:
    """Register one CPU arena for every session of the process (session.use_env_allocators)."""
    global _ENV_ARENA
    if not _ENV_ARENA:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        _ENV_ARENA = True


class OnnxEngine(EngineBase):
    """Serves every budget of one checkpoint from lazily created, cached ORT sessions."""

    def __init__(self, model_dir: Path, options: EngineOptions, info: ModelInfo) -> None:
        _, cfg = checkpoint_config(model_dir)
        super().__init__(model_dir, cfg, options)
        self.info = info
        self.precision = options.precision
        self.layout = "chain" if options.prepack else "whole"
        self.cache = GraphCache(options.cache_dir or Path(model_dir) / "onnx",
                                cache_key(info.checksum, self.precision, self.layout), f"{self.precision}-{self.layout}")
        store = self.cache.load_store()
        if store is None:
            state = load_state(Path(model_dir), cfg)
            order = head_order(gate_params(state))
            store = pack(state, cfg, HeadPlan(cfg, order).perms, self.precision)
            store["order"] = order
            self.cache.save_store(store, {"checksum": info.checksum, "precision": self.precision,
                                          "layout": self.layout, "builder": G.BUILDER_VERSION})
        self.plan = HeadPlan(cfg, store.pop("order").astype(np.int64))
        self.store = store
        self._slices: dict[str, np.ndarray] = {}  # int8 Q/K/V column slices shared by sessions
        self._values: dict[str, ort.OrtValue] = {}  # one OrtValue per initializer name; must outlive sessions
        self._sessions: dict[Any, ort.InferenceSession] = {}
        self._counts: dict[float, tuple[int, ...]] = {}
        self._run_options = ort.RunOptions()
        _shared_arena()

    # -- sessions ---------------------------------------------------------------------------------------
    def _session(self, key: Any, name: str, arrays: Arrays, build: Callable[[], onnx.ModelProto],
                 prepack: bool) -> Any:
        """The C-level session for ``key`` (created on first use); the Python wrapper's checks cost ~20 us/run."""
        sess = self._sessions.get(key)
        if sess is None:
            so = ort.SessionOptions()
            so.intra_op_num_threads = self.options.threads
            so.inter_op_num_threads = 1
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.add_session_config_entry("session.use_env_allocators", "1")
            if not prepack:
                so.add_session_config_entry("session.disable_prepacking", "1")
            for n, a in arrays.items():
                if n not in self._values:
                    self._values[n] = ort.OrtValue.ortvalue_from_numpy(a)
                so.add_initializer(n, self._values[n])
            try:
                path = self.cache.graph(name, build)
                sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
                raise ModelLoadError(f"building ONNX graph {name} for {self.model_dir} failed: {e}") from e
            self._sessions[key] = sess
        return sess._sess

    def _whole(self, counts: tuple[int, ...]) -> Any:
        c, p = self.cfg, self.precision
        arrays = G.bind(self.store, c, counts, p, self._slices)
        name = "whole-" + "-".join(map(str, counts))
        return self._session(counts, name, arrays, lambda: G.build_graph(c, counts, p, arrays), prepack=False)

    def _piece(self, kind: str, layer: int = 0, k: int = 0) -> Any:
        c, p = self.cfg, self.precision
        arrays = G.segment_arrays(self.store, c, kind, layer, k, p, self._slices)
        name = f"{kind}-l{layer}-k{k}"
        prepack = kind != "attn" or self.options.prepack_attention
        return self._session((kind, layer, k), name, arrays, lambda: G.build_segment(c, kind, layer, k, p, arrays),
                             prepack)

    # -- EngineBase -------------------------------------------------------------------------------------
    def layer_counts(self, budget: float) -> tuple[int, ...]:
        counts = self._counts.get(budget)
        if counts is None:
            counts = self._counts[budget] = self.plan.layer_counts(budget)
        return counts

    def forward_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray, budget: float) -> np.ndarray:
        counts = self.layer_counts(budget)
        ro = self._run_options
        if self.layout == "whole":
            feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
            return self._whole(counts).run(["logits"], feeds, ro)[0]  # type: ignore[no-any-return]
        mask = ort.OrtValue.ortvalue_from_numpy(attention_mask)._get_c_value()
        ids = ort.OrtValue.ortvalue_from_numpy(input_ids)._get_c_value()
        out = self._piece("embed").run_with_ort_values({"input_ids": ids, "attention_mask": mask}, ["x", "bias"], ro)
        x, bias = out[0], out[1]  # (B*N, D), (B, 1, 1, N)
        for layer, k in enumerate(counts):
            x = self._piece("attn", layer, k).run_with_ort_values({"x": x, "bias": bias}, ["y"], ro)[0]
            x = self._piece("ffn", layer).run_with_ort_values({"x": x}, ["y"], ro)[0]
        logits = self._piece("head").run_with_ort_values({"x": x, "attention_mask": mask}, ["logits"], ro)[0]
        return logits.numpy()  # type: ignore[no-any-return]

    def warmup(self) -> None:
        """Create every session the 19-budget grid needs and run each once on a short input."""
        ids = np.full((1, 8), 101, dtype=np.int64)
        mask = np.ones((1, 8), dtype=np.int32)
        for b in BUDGET_GRID:
            self.forward_ids(ids, mask, b)

    def close(self) -> None:
        self._sessions.clear()
        self._values.clear()

    @property
    def n_sessions(self) -> int:
        return len(self._sessions)
