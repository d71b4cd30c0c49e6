"""`make run` serves once the checkpoint is trained, and has the server make the decider behind budget=auto."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _planned(target: str, checkpoint: Path) -> list[list[str]]:
    """The headbudget commands `make TARGET` would run for ``checkpoint`` (a dry run; the install step taken as
    done), each as its words."""
    proc = subprocess.run(["make", "-n", "-o", ".venv/.installed", target, f"CHECKPOINT={checkpoint}",
                           "DATA=synthetic"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.replace("\\\n", " ").splitlines()
    return [ln.split()[1:] for ln in lines if ln.startswith(".venv/bin/headbudget ")]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_serves_once_trained_and_the_server_makes_the_decider(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")  # a trained checkpoint, as far as make can tell
    (serve,) = _planned("run", checkpoint)  # the decider, the sweep and the benchmark do not come first
    assert serve[0] == "serve" and serve[serve.index("--decider-data") + 1] == "synthetic"
    assert [c[0] for c in _planned("train", checkpoint)] == ["decider"]  # `make train` still makes it
    (checkpoint / "decider.json").write_text("{}")
    later = time.time() + 5
    os.utime(checkpoint / "decider.json", (later, later))
    assert _planned("train", checkpoint) == []  # not rebuilt while the checkpoint is unchanged
