"""experiments/gpu_seeds.sh end to end on this CPU (smoke recipe, tiny base): what a lent GPU call returns, and
that its sweeps rebuild as stand-ins here. A broken script would cost a whole lent call to find."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from headbudget.experiments import gpu_transfer, standin
from headbudget.models.pretrained import minilm_path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu_seeds.sh"


def test_one_call_returns_each_runs_sweep_and_the_sweeps_become_standins(tmp_path: Path) -> None:
    gpu_transfer.carry(tmp_path / ".carry", minilm_path(), ("ag_news",))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "HB_DEVICE": "cpu", "HB_EXITS": "1", "HB_EVERY": "2",
           "HB_MINILM": str(tmp_path / "minilm"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "HB_RECIPE": "--base tiny --data synthetic --recipe smoke --set dense_epochs=1 --set budget_epochs=1 "
                        "--set synthetic_size=600"}
    proc = subprocess.run(["bash", str(SCRIPT), "13"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    progress = (out / "progress.log").read_text()
    assert "m13 exit 0" in progress and "a13 exit 0" in progress, progress
    assert sorted(p.name for p in out.iterdir()) == ["a13.tar.gz", "m13.tar.gz", "progress.log"]  # <= 8 files back
    runs = tmp_path / "back"
    for name in ("m13", "a13"):
        with tarfile.open(out / f"{name}.tar.gz") as tar:
            tar.extractall(runs, filter="data")
        assert (runs / f"{name}.log").is_file() and (runs / name / "stages" / "hard" / "done.json").is_file()
    model_sweep = json.loads((runs / "m13" / "sweep.json").read_text())
    assert model_sweep["scope"] == "model" and model_sweep["exits"] == [1]
    for name in ("m13", "a13"):  # what scope_retime does with them here
        sweep = standin.read_sweep(runs / name / "sweep.json")
        assert standin.build(sweep, "tiny", None).gates.order().tolist() == sweep["head_order"]


def test_without_the_device_tools_out_it_stops_at_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "OUT is not set" in proc.stdout and not (tmp_path / "runs").exists()
