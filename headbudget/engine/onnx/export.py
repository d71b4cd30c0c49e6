"""One budget of a checkpoint as a standalone ONNX model: only the kept units, every weight inside the file.

The graph is the engine's own whole-model graph for the budget's plan (``build_graph``: per-layer head counts
and, for whole-model budgets, feed-forward widths), with the weight store's arrays for exactly those heads and
neurons (``bind``: per-layer prefixes) written as real initializers instead of the in-memory placeholders the
engine's sessions use. So the file computes what the engine computes at that budget, and plain ONNX Runtime
runs it with no headbudget code: it uses standard ops and ONNX Runtime's com.microsoft contrib ops
(FusedMatMul, Gelu; DynamicQuantizeMatMul in int8), which every ONNX Runtime build has.
``headbudget-export.json`` beside it says what a caller needs (inputs, labels, how texts are truncated), and a
``config.json`` lets stock Hugging Face runtimes load the folder without custom code (``hf_config``)::

    from optimum.onnxruntime import ORTModelForSequenceClassification
    model = ORTModelForSequenceClassification.from_pretrained("exported/b05")  # the labels from config.json

Example (the second half needs only onnxruntime, numpy and tokenizers)::

    headbudget export --model checkpoints/ag_news-quick --budget 0.5 --format onnx --out exported/b05

    import json, numpy as np, onnxruntime as ort
    from tokenizers import Tokenizer
    meta = json.load(open("exported/b05/headbudget-export.json"))
    tok = Tokenizer.from_file("exported/b05/tokenizer.json"); tok.no_padding(); tok.no_truncation()
    ids = tok.encode("Stocks rallied as oil prices fell.").ids  # truncate past meta["max_length"] as it says
    sess = ort.InferenceSession("exported/b05/model.onnx", providers=["CPUExecutionProvider"])
    logits = sess.run(["logits"], {"input_ids": np.array([ids], np.int64),
                                   "attention_mask": np.ones((1, len(ids)), np.int64)})[0]  # (1, n_labels)
    print(meta["labels"][int(logits[0].argmax())])
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from headbudget.engine.artifacts import checkpoint_config, checkpoint_digest
from headbudget.engine.errors import EngineError
from headbudget.engine.onnx import bind as B
from headbudget.engine.onnx import graph as G
from headbudget.engine.types import Precision
from headbudget.engine.weights.pack import gate_params, load_state, pack
from headbudget.engine.weights.store import WeightStore
from headbudget.models.budget import head_order
from headbudget.models.config import ModelConfig
from headbudget.models.model_types import model_type
from headbudget.models.plan import BudgetPolicy, ExecutionPlan, Shape
from headbudget.models.tokenizer import TOKENIZER_FILES

MODEL_FILE = "model.onnx"
META_FILE = "headbudget-export.json"
HF_CONFIG_FILE = "config.json"
MASK = "attention_mask"


class ExportError(EngineError):
    """A checkpoint, budget or output folder that cannot be exported; the message is one line."""


@dataclass(frozen=True)
class OnnxExport:
    """What ``export_onnx`` wrote (also the content of headbudget-export.json, less the folder)."""

    folder: str
    budget: float
    precision: str
    heads_per_layer: tuple[int, ...]
    heads_kept: int
    heads_total: int
    neurons_per_layer: tuple[int, ...]  # feed-forward neurons kept per layer (all of them: attention scope)
    neurons_kept: int
    neurons_total: int
    labels: tuple[str, ...]
    max_length: int  # the truncation length the checkpoint was trained with (else max_position)
    max_position: int  # the longest sequence the file accepts (its position table)
    macs_fraction: float  # whole-forward multiply-adds of one max_length text against the dense model's (plan.cost)
    pad_token_id: int
    source_weights_sha256: str
    size_bytes: int


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty folder")


def standalone(model: onnx.ModelProto, arrays: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with its placeholder initializers replaced by the arrays themselves (copies, contiguous)."""
    del model.graph.initializer[:]
    model.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(a), name)
                                   for name, a in sorted(arrays.items()))
    return model


def export_onnx(model_dir: Path, budget: float, out: Path, precision: Precision = "fp32") -> OnnxExport:
    """Write ``out/model.onnx`` (the checkpoint at ``budget``, dropped heads and neurons removed) and its metadata."""
    model_dir, out = Path(model_dir), Path(out)
    if not 0.0 < budget <= 1.0:
        raise ExportError(f"budget must be in (0, 1], got {budget}")
    config, cfg = checkpoint_config(model_dir)
    if not model_type(cfg.model_type).static_plans:
        raise ExportError(f"{model_dir}: a {cfg.model_type} checkpoint chooses its heads per input, so no one "
                          "graph holds a budget; only budgeted checkpoints export")
    _check_out(out)
    state = load_state(model_dir, cfg)
    policy = BudgetPolicy(cfg, head_order(gate_params(state)))
    plan = policy.plan(budget)
    model = _standalone_graph(pack(state, cfg, policy, precision), cfg, plan, precision)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / MODEL_FILE))
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    max_length = min(int(config.get("max_length", cfg.max_position)), cfg.max_position)
    cost = plan.cost(Shape.of(cfg), max_length)
    record = OnnxExport(
        folder=str(out), budget=budget, precision=precision, heads_per_layer=plan.heads, heads_kept=sum(plan.heads),
        heads_total=cfg.total_heads, neurons_per_layer=plan.ffn_widths(cfg.intermediate_size),
        neurons_kept=cost.neurons_active, neurons_total=cost.neurons_total, labels=cfg.labels, max_length=max_length,
        max_position=cfg.max_position, macs_fraction=round(cost.ratio, 4), pad_token_id=cfg.pad_token_id,
        source_weights_sha256=checkpoint_digest(model_dir), size_bytes=(out / MODEL_FILE).stat().st_size)
    (out / META_FILE).write_text(json.dumps(_meta(record, model_dir, cfg), indent=2) + "\n")
    (out / HF_CONFIG_FILE).write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return record


def _standalone_graph(store: WeightStore, cfg: ModelConfig, plan: ExecutionPlan,
                      precision: Precision) -> onnx.ModelProto:
    """The engine's graph for ``plan`` with its weights inside, an int64 mask and a stated output shape."""
    arrays = B.bind(store, cfg, plan, B.SliceCache())
    model = _int64_mask(standalone(G.build_graph(cfg, plan, precision, arrays), arrays))
    model.producer_name = "headbudget-export"
    # The engine's graphs leave the output's shape open; a standalone file states it (the checker wants one).
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", cfg.n_labels]))
    onnx.checker.check_model(model)
    return model


def _meta(record: OnnxExport, model_dir: Path, cfg: ModelConfig) -> dict[str, object]:
    """The metadata file (META_FILE): the export's record and how to feed the graph and read its output."""
    meta: dict[str, object] = {k: v for k, v in asdict(record).items() if k != "folder"}
    meta |= {
        "source": str(model_dir),
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
                   {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"],
                    "note": "1 for tokens, 0 for padding (pad on the right)"}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", len(cfg.labels)],
                     "note": "one column per label, in the order of labels"}],
        "tokenizer": "tokenizer.json with its padding and truncation turned off (Tokenizer.no_padding(), "
                     "no_truncation()); a text longer than max_length keeps its first max_length - 1 tokens and "
                     "its final special token, as headbudget's encoder does; the file accepts up to max_position "
                     "tokens (the engine's limit when it is given no max_length)",
        "macs_fraction_note": "multiply-adds of the whole forward pass of one max_length text at this budget, "
                              "as a fraction of the dense model's (attention, feed-forward and classifier matrices)",
    }
    return meta


def _int64_mask(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph's int32 attention mask taken as int64, as tokenizers and Hugging Face runtimes hand it over."""
    inner = "attention_mask_int32"
    for node in model.graph.node:
        node.input[:] = [inner if name == MASK else name for name in node.input]
    model.graph.node.insert(0, helper.make_node("Cast", [MASK], [inner], to=TensorProto.INT32))
    for value in model.graph.input:
        if value.name == MASK:
            value.type.tensor_type.elem_type = TensorProto.INT64
    return model


def hf_config(cfg: ModelConfig) -> dict[str, object]:
    """config.json as stock Hugging Face tools read an ONNX classifier folder (optimum's
    ORTModelForSequenceClassification, Infinity's optimum engine): BERT's model type, the labels and the
    tokenizer-facing sizes. The graph in model.onnx is what runs; no custom code is named."""
    return {
        "architectures": ["BertForSequenceClassification"], "model_type": "bert",
        "id2label": dict(enumerate(cfg.labels)), "label2id": {label: i for i, label in enumerate(cfg.labels)},
        "problem_type": "single_label_classification",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.intermediate_size, "hidden_act": "gelu",
        "max_position_embeddings": cfg.max_position, "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": cfg.pad_token_id,
    }
