"""The dense runtimes the benchmark compares against: Hugging Face BERT (eager, sdpa) and ONNX Runtime.

The Hugging Face model carries our checkpoint's encoder weights (BertForSequenceClassification uses a
[CLS] pooler where we mean-pool: one D x D product on one token, immaterial for latency). ORT dense is that
model exported once by torch's standard (TorchScript) exporter and run with graph optimisations on and one
intra-op thread; ORT int8 is the same file after onnxruntime.quantization.quantize_dynamic.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.pretrained import hf_key

Runner = Callable[[np.ndarray, np.ndarray], object]


def hf_model(model: BudgetedClassifier, attn: str) -> torch.nn.Module:
    """BertForSequenceClassification with ``model``'s encoder weights, eval mode."""
    from transformers import BertConfig, BertForSequenceClassification

    c = model.cfg
    config = BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.n_layers,
                        num_attention_heads=c.n_heads, intermediate_size=c.intermediate_size,
                        max_position_embeddings=c.max_position, type_vocab_size=c.type_vocab_size,
                        layer_norm_eps=c.layer_norm_eps, num_labels=c.n_labels,  # type: ignore[call-arg]
                        attn_implementation=attn)  # BertConfig takes these through **kwargs; the stub omits them
    hf = BertForSequenceClassification(config)
    hf.eval()  # type: ignore[no-untyped-call]  # transformers leaves Module.eval's override unannotated
    state = hf.state_dict()
    for name, value in model.state_dict().items():
        if name.startswith("encoder."):
            state["bert." + hf_key(name)] = value
    hf.load_state_dict(state)
    return hf


def torch_runner(module: torch.nn.Module) -> Runner:
    def run(ids: np.ndarray, mask: np.ndarray) -> object:
        with torch.inference_mode():
            return module(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)))
    return run


def export_dense(model: BudgetedClassifier, folder: Path) -> tuple[Path, Path]:
    """dense.onnx (standard exporter) and dense-int8.onnx (dynamic quantization) in ``folder``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folder.mkdir(parents=True, exist_ok=True)
    fp32, int8 = folder / "dense.onnx", folder / "dense-int8.onnx"
    hf = hf_model(model, "eager")
    ids = torch.full((1, 16), 1000, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(hf, (ids, torch.ones_like(ids)), str(fp32), input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": {0: "b", 1: "n"}, "attention_mask": {0: "b", 1: "n"}})
        # The quantizer logs through the root logger, a line for every tensor it leaves in fp32: not ours to show.
        root, level = logging.getLogger(), logging.getLogger().level
        root.setLevel(logging.ERROR)
        try:
            quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
        finally:
            root.setLevel(level)
    return fp32, int8


def ort_session(path: Path, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_runner(session: ort.InferenceSession) -> Runner:
    def run(ids: np.ndarray, mask: np.ndarray) -> object:
        return session.run(["logits"], {"input_ids": ids, "attention_mask": mask.astype(np.int64)})
    return run
