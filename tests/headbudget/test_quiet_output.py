"""What `make run` prints is ours: the libraries it drives (ONNX Runtime's quantizer, transformers) add nothing."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli


def test_an_int8_bench_prints_its_table_and_nothing_else(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # int8 builds ONNX Runtime's quantized dense export, whose quantizer logs a line for every tensor it skips.
    proc = run_cli("bench", "--model", str(tiny_checkpoint), "--precision", "int8", "--seq-len", "16", "--repeats", "2",
                   "--no-memory", "--out", str(tmp_path / "bench.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("cpu: ") and "precision: int8" in proc.stdout
    assert proc.stderr == "", proc.stderr[-2000:]
