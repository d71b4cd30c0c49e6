"""ONNX Runtime backend: head- and neuron-sliced graphs over one shared copy of the weights, one intra-op thread.

A budget's plan (``BudgetPolicy.plan``, models/plan.py) says what runs: per layer the first ``heads[l]`` heads of
the layer's head order and, for whole-model budgets, the first ``ffn[l]`` feed-forward neurons of its neuron order;
sessions and their cached feeds are keyed by ``plan.key``.

Memory: sessions receive their weights as OrtValues over numpy views of one weight store (engine/weights/), so
they add graph structure, not weights, and draw activations from one process-wide arena, which gives its free
regions back after a large batch (``give_back``; docs/results.md, 'Memory under large requests').

Layouts (``Layout``, chosen by ``EngineOptions.prepack``):
- ``dynamic``: one all-budget session (one more per exit depth a plan stops at). Per layer an If node picks the
  branch: at full width the weights are prepacked initializers; at fewer units the prefix slices are graph
  inputs, which ONNX Runtime never prepacks, so no budget adds a packed copy. Packed levels
  (``PrecisionSpec.ffn_levels``, ``attention_levels``) run their largest level within the plan from prepacked
  weights; small plans (``PrecisionSpec.fed_up_to``) run a second session without If nodes, every block fed.
  Budgets in ``prepacked_budgets`` (and a decider's hot budgets) get a prepacked session of their own.
- ``whole``: one unpacked graph per plan, nothing prepacked: the least memory, slower per call.
Their costs are in docs/results.md, 'Every budget costs what it says'.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from headbudget.engine.artifacts import checkpoint_config
from headbudget.engine.base import EngineBase
from headbudget.engine.errors import ModelLoadError
from headbudget.engine.onnx import bind as B
from headbudget.engine.onnx import graph as G
from headbudget.engine.onnx.cache import GraphCache, cache_key
from headbudget.engine.onnx.runner import Runner
from headbudget.engine.precision import PRECISIONS
from headbudget.engine.types import BenchRecord, EngineOptions, ExecutionPlan, ModelInfo
from headbudget.engine.weights.pack import gate_params, load_state, pack
from headbudget.engine.weights.store import Arrays, Embeddings, WeightStore
from headbudget.models.budget import BUDGET_GRID, head_order
from headbudget.models.plan import BudgetPolicy

log = logging.getLogger(__name__)
_ENV_ARENA = False
_COPIES_CAP = 4  # times the store's W1: what int8's fed W1 columns may hold (OnnxEngine._bound_copies)
_TWO = (np.array([[101, 102]], dtype=np.int64), np.ones((1, 2), dtype=np.int32))  # [CLS] [SEP]
_TIMED_TOKENS = 64  # the length /v1/models states latency at when the engine times itself (about AG News')


def _shared_arena() -> None:
    """Register one CPU arena for every session of the process (session.use_env_allocators)."""
    global _ENV_ARENA
    if not _ENV_ARENA:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        _return_large_frees()
        _ENV_ARENA = True


def _return_large_frees() -> None:
    """Have glibc give blocks of 1 MiB and more back to the system when they are freed (a fixed M_MMAP_THRESHOLD):
    by default the threshold rises to the largest block freed, and the arena's regions freed after a large batch
    stay in the heap (docs/results.md, 'Memory under large requests'). Fixing it also fixes the heap's trim
    threshold at its 128 KiB default: every free that left that much at the heap's top gave it back, and the next
    allocation faulted it in again, which made a 64-text request's word count 12x slower; 8 MiB keeps a few of
    those blocks at hand."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 8 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: its own policy
        pass


class Layout(StrEnum):
    """How the sessions serve budgets (module docstring); the value is part of the graph cache's key and folder."""

    DYNAMIC = "dynamic"  # one all-budget session: prepacked full-width weights, prefix slices fed as inputs
    WHOLE = "whole"  # one unpacked graph per plan


class OnnxEngine(EngineBase):
    """Serves every budget of one checkpoint from lazily created, cached ORT sessions."""


    def __init__(self, model_dir: Path, options: EngineOptions, info: ModelInfo) -> None:
        _, cfg = checkpoint_config(model_dir)
        super().__init__(model_dir, cfg, options)
        self.info = info
        self.precision = options.precision
        self.layout = Layout.DYNAMIC if options.prepack else Layout.WHOLE
        self.levels = B.Levels.of(cfg, self.precision) if self.layout is Layout.DYNAMIC else B.Levels()
        self.cache = GraphCache(options.cache_dir or Path(model_dir) / "onnx",
                                cache_key(info.checksum, self.precision, self.layout, repr(self.levels)),
                                f"{self.precision}-{self.layout}")
        self.store, order = self._weights()
        self.policy = BudgetPolicy(cfg, order.astype(np.int64))
        self._slices = B.SliceCache()  # int8 Q/K/V column prefixes and dummy feeds, shared by sessions
        self._values: dict[str, ort.OrtValue] = {}  # one OrtValue per initializer name; must outlive sessions
        self._sessions: dict[Any, Runner] = {}
        # The dynamic layout's sessions, by (exit depth (None: all layers), whether it is the graph without
        # branches for small plans).
        self._dyn: dict[tuple[int | None, bool], Runner] = {}
        # plan.key -> the session that runs it and its per-plan inputs, chosen and made on the plan's first call
        self._runs: dict[Hashable, tuple[Runner, dict[str, Any]]] = {}
        self._keep: dict[Hashable, list[np.ndarray]] = {}  # plan.key -> the arrays behind its feed OrtValues
        # int8's fed W1 columns (SliceCache.w1_columns) are copies, one per layer and neuron range: the grid's
        # budgets fit under the cap, every plan the policy can make would not; past it the plans least recently
        # run are dropped (``_bound_copies``).
        self._copies_cap = _COPIES_CAP * sum(lw.w1.nbytes for lw in self.store.layers)
        self._prepacked = self._prepacked_plans()
        self._logits = ["logits"]
        self._run_options = ort.RunOptions()
        self._shrink = ort.RunOptions()  # the arena frees its unused regions when a run with these ends
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        _shared_arena()

    def _weights(self) -> tuple[WeightStore, np.ndarray]:
        """The weight store and its unit ranking: from the cache, else packed from the checkpoint and cached."""
        cached = self.cache.load_store(self.cfg, self.precision)
        if cached is not None:
            return cached
        state = load_state(self.model_dir, self.cfg)
        order = head_order(gate_params(state))  # flat unit ranking: heads (and feed-forward groups)
        store = pack(state, self.cfg, BudgetPolicy(self.cfg, order), self.precision)
        self.cache.save_store(store, order, {"checksum": self.info.checksum, "precision": self.precision,
                                             "layout": self.layout, "builder": G.BUILDER_VERSION})
        return store, order

    def _prepacked_plans(self) -> set[Hashable]:
        """The plans with a prepacked session of their own: ``prepacked_budgets`` and a decider's hot budgets, in
        the dynamic layout without packed feed-forward levels (with them a budget's own session is no faster),
        except plans that run every layer whole (the all-budget session's full-width branches serve them)."""
        if self.layout is not Layout.DYNAMIC or self.levels.neurons:
            return set()
        decider = self.info.decider
        budgets = self.options.prepacked_budgets
        hot = decider.hot_budgets() if decider is not None and budgets else ()
        plans = [self.policy.plan(b) for b in (*budgets, *hot)]
        return {plan.key for plan in plans if not self._whole_model(plan)}

    # -- sessions ---------------------------------------------------------------------------------------
    def _session(self, key: Any, name: str, arrays: Arrays, build: Callable[[], onnx.ModelProto],
                 prepack: bool) -> Runner:
        """The session for ``key`` (created on first use), behind the fast-path seam of ``runner``."""
        sess = self._sessions.get(key)
        if sess is None:
            so = ort.SessionOptions()
            so.intra_op_num_threads = self.options.threads
            so.inter_op_num_threads = 1
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.add_session_config_entry("session.use_env_allocators", "1")
            # Off: with it, the first run of each input shape allocates tensor by tensor beside its planned block,
            # well past max_activation_bytes' estimate, for no latency (docs/results.md, 'Memory under large requests').
            so.enable_mem_pattern = False
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
            sess = self._sessions[key] = Runner(sess, self._logits)
        return sess

    def _whole_model(self, plan: ExecutionPlan) -> bool:
        c = self.cfg
        return all(k == c.n_heads for k in plan.heads) and all(w == c.intermediate_size
                                                                 for w in plan.ffn_widths(c.intermediate_size))

    def _whole(self, plan: ExecutionPlan, prepack: bool = False) -> Runner:
        """The plan's own graph: unpacked (the whole layout), or prepacked for a budget in ``prepacked_budgets``."""
        c, p = self.cfg, self.precision
        arrays = B.bind(self.store, c, plan, self._slices)
        name = "whole-" + "-".join(map(str, plan.heads))
        if plan.ffn is not None:
            name += "-n-" + "-".join(map(str, plan.ffn))
        if plan.depth is not None:
            name += f"-d{plan.depth}"
        return self._session(("packed" if prepack else "whole", plan.key), name, arrays,
                             lambda: G.build_graph(c, plan, p, arrays), prepack=prepack)

    def _runner(self, plan: ExecutionPlan) -> tuple[Runner, dict[str, Any]]:
        """The session that runs ``plan`` and its feed dict, cached per plan (the dict is reused in place: one
        engine, one thread)."""
        run = self._runs.pop(plan.key, None)
        if run is None:
            if self.layout is Layout.DYNAMIC and plan.key not in self._prepacked:
                run = self._dynamic(plan)
            else:  # a prepacked budget, or any plan of the whole layout
                run = self._whole(plan, prepack=plan.key in self._prepacked), {}
            self._runs[plan.key] = run
            self._bound_copies()
        else:
            self._runs[plan.key] = run  # now the most recently run
        return run

    def _bound_copies(self) -> None:
        """Past the copies' cap, drop the plans least recently run, and the copies no kept plan feeds, until the
        copies are within it or only the plan just made is left."""
        copies = self._slices.w1_columns
        while sum(a.nbytes for a in copies.values()) > self._copies_cap and len(self._runs) > 1:
            oldest = next(iter(self._runs))
            del self._runs[oldest]
            self._keep.pop(oldest, None)
            used = {id(a) for arrays in self._keep.values() for a in arrays}
            for k in [k for k, a in copies.items() if id(a) not in used]:
                del copies[k]

    def _dynamic(self, plan: ExecutionPlan) -> tuple[Runner, dict[str, Any]]:
        """The all-budget session of the plan's depth (every layer, or those below its exit: one per exit used),
        with or without branches, and the plan's per-call inputs."""
        c, p, depth = self.cfg, self.precision, plan.depth
        fed = B.runs_fed(c, plan, PRECISIONS[p].fed_up_to)
        sess = self._dyn.get((depth, fed))
        if sess is None:
            levels = self.levels
            init = B.dynamic_arrays(self.store, c, self._slices, levels, depth, fed)
            name = ("fed" if fed else "dynamic") + ("" if depth is None else f"-d{depth}")
            sess = self._dyn[depth, fed] = self._session(
                name, name, init, lambda: G.build_dynamic(c, p, init, levels, depth, fed), prepack=True)
        arrays = B.dynamic_feeds(self.store, c, plan, self._slices, self.levels, fed)
        self._keep[plan.key] = list(arrays.values())
        return sess, {n: sess.value(a) for n, a in arrays.items()}

    # -- EngineBase -------------------------------------------------------------------------------------
    def make_plan(self, budget: float) -> ExecutionPlan:
        return self.policy.plan(budget)

    def forward_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray, plan: ExecutionPlan) -> np.ndarray:
        return self._run(input_ids, attention_mask, plan, self._run_options)

    def _run(self, input_ids: np.ndarray, attention_mask: np.ndarray, plan: ExecutionPlan,
             options: ort.RunOptions) -> np.ndarray:
        sess, feeds = self._runner(plan)
        # The cached feed dict is reused in place (an engine is single-threaded): no per-call dict copy.
        feeds["input_ids"], feeds["attention_mask"] = sess.value(input_ids), sess.value(attention_mask)
        return sess.run(feeds, options)

    def give_back(self, plan: ExecutionPlan) -> None:
        """ONNX Runtime shrinks its arena only as a run ends, when asked: one run of two tokens asks."""
        self._run(_TWO[0], _TWO[1], plan, self._shrink)

    def embedding_tables(self) -> Embeddings:
        return self.store.embeddings

    def warmup(self) -> None:
        """Create every session the budget grid needs and run each once on a short input. A checkpoint without
        bench.json gets its latency table here, timed on this engine in this process, which the service estimates
        latency from (a table from another process or machine can be far off)."""
        ids = np.full((1, 8), 101, dtype=np.int64)
        mask = np.ones((1, 8), dtype=np.int32)
        for b in BUDGET_GRID:
            self.forward_ids(ids, mask, self.plan(b))
        if self.info.bench is None:
            self.info = replace(self.info, bench=self._timed_grid())

    def _timed_grid(self, repeats: int = 3) -> BenchRecord:
        """The fastest of ``repeats`` passes of one text per grid budget, at three lengths."""
        lengths = sorted({min(n, self.max_length) for n in (16, _TIMED_TOKENS, 128)})
        table: dict[float, list[tuple[float, float]]] = {}
        for n in lengths:
            ids = np.full((1, n), 1000, dtype=np.int64)
            ids[0, 0], ids[0, -1] = 101, 102
            mask = np.ones((1, n), dtype=np.int32)
            for b in BUDGET_GRID:
                plan, best = self.plan(b), float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    self.forward_ids(ids, mask, plan)
                    best = min(best, time.perf_counter() - t0)
                table.setdefault(b, []).append((float(n), best * 1000))
        return BenchRecord(table=table, reference_tokens=float(min(_TIMED_TOKENS, self.max_length)))

    def close(self) -> None:
        self._dyn.clear()
        self._runs.clear()
        self._keep.clear()
        self._sessions.clear()
        self._values.clear()

    @property
    def n_sessions(self) -> int:
        return len(self._sessions)
