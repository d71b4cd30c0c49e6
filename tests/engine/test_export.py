"""`headbudget export --format onnx`: a standalone file with only the kept heads that bare ONNX Runtime runs
with the engine's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from headbudget.engine.artifacts import checkpoint_config
from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.engine.weights.pack import gate_params, load_state
from headbudget.models.budget import head_order
from headbudget.models.plan import BudgetPolicy
from tests.conftest import run_cli

# Three lengths, and one text past max_length (512 tokens here) to check the truncation the metadata describes.
TEXTS = ["Stocks rallied on Wall Street as oil prices fell.", "New chip",
         "The striker scored twice in the final minutes of the match against the league leaders.",
         "Markets " * 600]

# Runs in a fresh interpreter that may import only onnxruntime, numpy and tokenizers: what a user without
# headbudget has. It truncates and pads on the right as headbudget-export.json says, and prints the logits.
BARE = """
import json, sys
import numpy as np, onnxruntime as ort
from tokenizers import Tokenizer
folder, texts, alone = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "alone"
meta = json.load(open(f"{folder}/headbudget-export.json"))
tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
tok.no_padding(); tok.no_truncation()
m = meta["max_length"]
rows = [e.ids if len(e.ids) <= m else e.ids[:m - 1] + e.ids[-1:] for e in tok.encode_batch(texts)]
so = ort.SessionOptions(); so.intra_op_num_threads = 1
sess = ort.InferenceSession(f"{folder}/model.onnx", so, providers=["CPUExecutionProvider"])
def run(batch):
    n = max(map(len, batch))
    ids = np.full((len(batch), n), meta["pad_token_id"], np.int64)
    mask = np.zeros((len(batch), n), np.int64)
    for i, r in enumerate(batch):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return sess.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
logits = np.concatenate([run([r]) for r in rows]) if alone else run(rows)
assert not [m for m in sys.modules if m.startswith("headbudget")]
print(json.dumps(logits.tolist()))
"""


def bare_logits(folder: Path, alone: bool) -> np.ndarray:
    """The export's logits for TEXTS, padded into one batch, or each text ``alone``."""
    proc = subprocess.run([sys.executable, "-c", BARE, str(folder), json.dumps(TEXTS), "alone" if alone else "batch"],
                          capture_output=True, text=True, timeout=120, cwd=folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return np.array(json.loads(proc.stdout))


def engine_logits(checkpoint: Path, budget: float, precision: str, cache: Path, alone: bool,
                  texts: list[str] = TEXTS) -> np.ndarray:
    """The engine's logits for ``texts``, as one batch (which it runs in passes by length) or each text ``alone``."""
    engine = load_engine(checkpoint, EngineOptions(precision=precision, cache_dir=cache))  # type: ignore[arg-type]
    try:
        predictions = [p for t in texts for p in engine.predict([t], budget).predictions] if alone \
            else engine.predict(texts, budget).predictions
        assert [p.truncated for p in predictions] == [len(t) > 1000 for t in texts]
        return np.array([p.logits for p in predictions])
    finally:
        engine.close()


@pytest.mark.parametrize("budget, precision", [(0.5, "fp32"), (1.0, "fp32"), (0.5, "int8"), (0.25, "int8")])
def test_bare_onnxruntime_gives_the_engines_logits(minilm_shaped_checkpoint: Path, tmp_path: Path, budget: float,
                                                   precision: str) -> None:
    out = tmp_path / "export"
    proc = run_cli("export", "--model", str(minilm_shaped_checkpoint), "--budget", str(budget),
                   "--precision", precision, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "headbudget-export.json").read_text())
    assert meta["max_length"] == meta["max_position"] == 512  # so the engine truncates where the recipe does
    # int8 quantizes each pass's activations as a whole, and the engine runs a batch in passes by length: there
    # both sides run each text alone; fp32 answers do not depend on the batch, which checks the export's padding
    alone = precision == "int8"
    np.testing.assert_allclose(bare_logits(out, alone), engine_logits(minilm_shaped_checkpoint, budget, precision,
                                                                       tmp_path / "cache", alone), atol=1e-4, rtol=0)


def test_the_dense_folder_loads_as_a_stock_hugging_face_classifier(minilm_shaped_checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    """config.json names BERT and the labels, so transformers reads it without custom code, and the graph takes
    what Hugging Face runtimes feed (int64 ids and mask) and gives `logits`."""
    from transformers import AutoConfig

    out = tmp_path / "dense"
    assert run_cli("export", "--model", str(minilm_shaped_checkpoint), "--out", str(out)).returncode == 0
    config = AutoConfig.from_pretrained(out)  # no trust_remote_code
    _, cfg = checkpoint_config(minilm_shaped_checkpoint)
    assert config.model_type == "bert" and config.id2label == dict(enumerate(cfg.labels))
    graph = onnx.load(str(out / "model.onnx")).graph
    assert {i.name: i.type.tensor_type.elem_type for i in graph.input} == {
        "input_ids": onnx.TensorProto.INT64, "attention_mask": onnx.TensorProto.INT64}
    assert [o.name for o in graph.output] == ["logits"]


# Runs in the optimum environment (.venv-optimum, requirements/optimum.txt: optimum-onnx with ONNX Runtime, which
# needs transformers < 4.58, so it cannot share the project's): what Infinity's optimum engine does with a folder.
OPTIMUM = """
import json, sys
import numpy as np
from optimum.onnxruntime import ORTModelForSequenceClassification
from transformers import AutoTokenizer
folder, texts = sys.argv[1], json.loads(sys.argv[2])
model = ORTModelForSequenceClassification.from_pretrained(folder)
tokenizer = AutoTokenizer.from_pretrained(folder)
batch = tokenizer(texts, padding=True, return_tensors="np", return_token_type_ids=False)
logits = np.asarray(model(**batch).logits)
print(json.dumps({"logits": logits.tolist(), "labels": [model.config.id2label[int(i)] for i in logits.argmax(1)]}))
"""
OPTIMUM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-optimum" / "bin" / "python"


def optimum_python() -> Path:
    """The optimum environment's interpreter; `make test` builds it, so only a bare pytest run skips."""
    if not OPTIMUM_PYTHON.exists():
        pytest.skip("no .venv-optimum: `make test` (or `make .venv-optimum/.installed`) builds it")
    return OPTIMUM_PYTHON


def in_optimum(tmp_path: Path, *argv: str) -> str:
    """Run ``argv`` (a path relative to the optimum environment's bin, then its arguments) there; its stdout."""
    python = optimum_python()
    env = {"PATH": os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(python.parent / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def assert_optimum_answers_as_the_engine(checkpoint: Path, folder: Path, tmp_path: Path) -> None:
    """ORTModelForSequenceClassification on ``folder``: the engine's b = 1 labels and logits (fp32, one batch)."""
    short = TEXTS[:3]  # the fourth is past the token limit, where truncation rules differ
    got = json.loads(in_optimum(tmp_path, "python", "-c", OPTIMUM, str(folder), json.dumps(short)).splitlines()[-1])
    _, cfg = checkpoint_config(checkpoint)
    want = engine_logits(checkpoint, 1.0, "fp32", tmp_path / "cache", alone=False, texts=short)
    assert got["labels"] == [cfg.labels[int(i)] for i in want.argmax(1)]
    np.testing.assert_allclose(np.array(got["logits"]), want, atol=1e-4, rtol=0)


def test_optimum_answers_the_engines_labels(minilm_shaped_checkpoint: Path, tmp_path: Path) -> None:
    """ORTModelForSequenceClassification (what Infinity's optimum engine runs) loads the exported dense folder,
    unchanged, and answers with the engine's b = 1 labels and logits."""
    out = tmp_path / "dense"
    assert run_cli("export", "--model", str(minilm_shaped_checkpoint), "--out", str(out)).returncode == 0
    assert_optimum_answers_as_the_engine(minilm_shaped_checkpoint, out, tmp_path)


def test_optimum_cli_exports_the_hf_folder(minilm_shaped_checkpoint: Path, tmp_path: Path) -> None:
    """`export --format hf` writes a standard folder: `optimum-cli export onnx` accepts it (it refuses folders with
    custom code) and the ONNX model it writes answers with the engine's b = 1 labels and logits."""
    hf, onnx_dir = tmp_path / "hf", tmp_path / "hf-onnx"
    proc = run_cli("export", "--model", str(minilm_shaped_checkpoint), "--format", "hf", "--out", str(hf))
    assert proc.returncode == 0, proc.stderr
    assert "no remote code" in proc.stdout and "budgets and exits stay in headbudget" in proc.stdout
    in_optimum(tmp_path, "optimum-cli", "export", "onnx", "--model", str(hf), "--task", "text-classification",
               str(onnx_dir))
    assert_optimum_answers_as_the_engine(minilm_shaped_checkpoint, onnx_dir, tmp_path)


def test_only_the_kept_heads_are_in_the_file(minilm_shaped_checkpoint: Path, tmp_path: Path) -> None:
    for b in (0.5, 1.0):
        assert run_cli("export", "--model", str(minilm_shaped_checkpoint), "--budget", str(b),
                       "--out", str(tmp_path / str(b))).returncode == 0
    _, cfg = checkpoint_config(minilm_shaped_checkpoint)
    counts = BudgetPolicy(cfg, head_order(gate_params(load_state(minilm_shaped_checkpoint, cfg)))).plan(0.5).heads
    meta = json.loads((tmp_path / "0.5" / "headbudget-export.json").read_text())
    assert tuple(meta["heads_per_layer"]) == counts and meta["heads_kept"] == sum(counts) < cfg.total_heads
    half = {t.name: tuple(t.dims) for t in onnx.load(str(tmp_path / "0.5" / "model.onnx")).graph.initializer}
    full = {t.name: tuple(t.dims) for t in onnx.load(str(tmp_path / "1.0" / "model.onnx")).graph.initializer}
    dh = cfg.head_dim
    for layer, k in enumerate(counts):  # Q/K/V rows and W_O rows of exactly the kept heads, or none at all
        wqkv = [shape for name, shape in half.items() if name.startswith(f"l{layer}.wqkv")]
        assert wqkv == ([(3 * k * dh, cfg.hidden_size)] if k else [])
    assert sum(np.prod(s) for s in half.values()) < sum(np.prod(s) for s in full.values())
    assert (tmp_path / "0.5" / "model.onnx").stat().st_size < (tmp_path / "1.0" / "model.onnx").stat().st_size
    dense = json.loads((tmp_path / "1.0" / "headbudget-export.json").read_text())
    assert meta["macs_fraction"] < dense["macs_fraction"] == 1.0


@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "budget must be a number in [0.1, 1]"),
    (["--budget", "0.05"], "budget must be a number in [0.1, 1]"),
    (["--budget", "1.5"], "budget must be a number in [0.1, 1]"),
    (["--budget", "0.5", "--format", "hf"], "holds the dense model only"),
    (["--format", "hf", "--precision", "int8"], "--precision applies to --format onnx"),
])
def test_bad_requests_are_one_line(tiny_checkpoint: Path, tmp_path: Path, args: list[str], message: str) -> None:
    proc = run_cli("export", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "x"), *args)
    assert proc.returncode == 2 and message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and not (tmp_path / "x").exists()


def test_folder_errors_are_one_line(tiny_checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    # The type is refused from config.json alone, so an adaptive type's config stands in for a trained one.
    adaptive = tmp_path / "budgetformer"
    adaptive.mkdir()
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["model"]["model_type"] = "budgetformer"
    (adaptive / "config.json").write_text(json.dumps(config))
    for args, message in ((["--model", str(tiny_checkpoint), "--out", str(tmp_path / "taken")], "not an empty folder"),
                          (["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], "does not exist"),
                          (["--model", str(adaptive), "--out", str(tmp_path / "o")], "chooses its heads per input")):
        proc = run_cli("export", "--budget", "0.5", *args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and not (tmp_path / "o").exists()
    assert [f.name for f in (tmp_path / "taken").iterdir()] == ["file"]
