"""Reference backend: the training-time PyTorch model with the hard mask as its gate.

It computes every head (and every feed-forward neuron) and multiplies the skipped ones by exactly 0, so it is
what the ONNX backend must match, not a fast path. One intra-op thread (torch's setting is process-wide, so it is set at load).
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import numpy as np
import torch

from headbudget.engine.base import EngineBase, check_budget
from headbudget.engine.errors import ModelLoadError
from headbudget.engine.precision import PRECISIONS
from headbudget.engine.types import EngineOptions, ExecutionPlan, ModelInfo
from headbudget.engine.weights.store import Embeddings
from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.checkpoint_meta import CheckpointError


class TorchEngine(EngineBase):
    """Engine over ``BudgetedClassifier`` in eval mode, no grad."""

    def __init__(self, model_dir: Path, options: EngineOptions, info: ModelInfo) -> None:
        spec = PRECISIONS.get(options.precision)
        if spec is None or not spec.torch_engines:
            raise ModelLoadError("the torch backend is the fp32 reference; use backend 'onnxruntime' for int8")
        try:
            self.model, _ = load_checkpoint(Path(model_dir))
        except CheckpointError as e:
            raise ModelLoadError(str(e)) from e
        super().__init__(model_dir, self.model.cfg, options)
        torch.set_num_threads(options.threads)
        self.info = info
        self.policy = self.model.gates.policy()  # the gates are fixed in eval: one ranking for every budget
        self._masks: dict[Hashable, np.ndarray] = {}
        self._tables: Embeddings | None = None

    def make_plan(self, budget: float) -> ExecutionPlan:
        plan = self.policy.plan(budget)
        # The executor's form of the plan: the (L, U) mask of heads and feed-forward groups. Masks are nested,
        # so the plan's per-layer counts fix the mask and its key may stand for it.
        self._masks[plan.key] = self.policy.mask(budget)
        return plan

    def meter_plan(self, budget: float) -> ExecutionPlan:
        return self.policy.plan(check_budget(budget))  # make_plan without the mask it caches for this thread

    def embedding_tables(self) -> Embeddings:
        if self._tables is None:
            e = self.model.encoder.embeddings

            def array(t: torch.Tensor) -> np.ndarray:
                return t.detach().float().numpy()

            pos_tt = e.position.weight + e.token_type.weight[0]  # as the weight store folds them
            self._tables = Embeddings(word=array(e.word.weight), pos_tt=array(pos_tt), emb_g=array(e.norm.weight),
                                      emb_b=array(e.norm.bias))
        return self._tables

    def forward_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray, plan: ExecutionPlan) -> np.ndarray:
        gate = torch.as_tensor(self._masks[plan.key], dtype=torch.float32)  # (L, U)
        with torch.inference_mode():
            logits = self.model(torch.from_numpy(input_ids), torch.from_numpy(attention_mask.astype(np.int64)), gate,
                                plan.depth)
        out: np.ndarray = logits.numpy()  # (B, C)
        return out
