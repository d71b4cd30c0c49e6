"""experiments/gpu_transfer.py: what travels to a lent GPU, and a checkpoint's way back, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headbudget.experiments import gpu_transfer
from headbudget.models.checkpoint import save_checkpoint
from headbudget.models.config import GateConfig
from headbudget.models.pretrained import from_pretrained, minilm_path


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """.carry laid out in a fresh folder, and the base that setup.sh rebuilds from it (as the lent machine does)."""
    root = tmp_path_factory.mktemp("device")
    gpu_transfer.carry(root / ".carry", minilm_path())
    base = root / "minilm"
    script = f"cd {root} && source .carry/setup.sh && python3 -c 'from headbudget.models.pretrained import " \
             "minilm_path; print(minilm_path())'"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HB_MINILM": str(base),  # python3 there is this interpreter
                               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(base)  # the package stand-in, ahead of the installed package
    return root, base


def test_carry_holds_the_base_in_fp16_the_data_and_a_working_setup(carried: tuple[Path, Path]) -> None:
    root, base = carried
    size = sum(f.stat().st_size for f in (root / ".carry").rglob("*") if f.is_file())
    assert size < 64 * 2**20  # what travels in one call
    assert {p.name for p in (root / ".carry" / "data").iterdir()} == set(gpu_transfer.DATASETS)
    original = load_file(str(minilm_path() / "model.safetensors"))
    rebuilt = load_file(str(base / "model.safetensors"))
    assert rebuilt.keys() == original.keys()
    for k, v in original.items():  # the base the GPU run starts from: MiniLM rounded to fp16
        assert rebuilt[k].dtype == torch.float32 and torch.equal(rebuilt[k], v.half().float())
    assert json.loads((base / "config.json").read_text()) == json.loads((minilm_path() / "config.json").read_text())


def test_a_run_comes_back_bit_for_bit(carried: tuple[Path, Path], tmp_path: Path) -> None:
    root, base = carried
    model = from_pretrained(base, ("a", "b"), GateConfig(scope="model"), seed=3).model
    with torch.no_grad():  # trained: every tensor but the frozen word embeddings moved
        for name, p in model.named_parameters():
            if not name.endswith("word.weight"):
                p.add_(0.01)
    run = tmp_path / "run"
    save_checkpoint(model, run, {"name": "run", "model_type": "budgeted"})
    (run / "sweep.json").write_text("{}")
    parts = gpu_transfer.pack(run, base, tmp_path / "out", cap_bytes=15_000_000)
    assert len(parts) >= 3 and all(p.stat().st_size < 16 * 2**20 for p in parts)
    back = gpu_transfer.unpack(tmp_path / "out", root / ".carry" / "base16", minilm_path(), tmp_path / "back")
    sent, got = load_file(str(run / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sent.keys() == got.keys() and all(torch.equal(sent[k], got[k]) for k in sent)
    assert (back / "sweep.json").read_text() == "{}" and (back / "tokenizer.json").is_file()
    with torch.no_grad():
        model.encoder.embeddings.word.weight.add_(0.01)
    save_checkpoint(model, run, {"name": "run", "model_type": "budgeted"})
    with pytest.raises(ValueError, match="word embeddings differ"):
        gpu_transfer.pack(run, base, tmp_path / "out2", cap_bytes=15_000_000)


def test_missing_data_or_parts_are_refused_before_anything_is_written(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError, match="no_such_set"):
        gpu_transfer.carry(tmp_path / ".carry", minilm_path(), ("ag_news", "no_such_set"))
    assert not (tmp_path / ".carry").exists()
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "keep").write_text("x")  # an existing folder that is not a carry stays
    assert gpu_transfer.main(["carry", "--out", str(tmp_path / "precious")]) == 2
    assert (tmp_path / "precious" / "keep").read_text() == "x"
    assert gpu_transfer.main(["pack", "--run", str(tmp_path), "--base", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err) and "not an earlier carry" in err[0]
