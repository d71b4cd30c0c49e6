"""`make run` builds what the README's features need before it serves: the decider behind budget=auto."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _planned(checkpoint: Path) -> list[str]:
    """The commands `make run` would run for ``checkpoint`` (a dry run; the install step taken as done)."""
    proc = subprocess.run(["make", "-n", "-o", ".venv/.installed", "run", f"CHECKPOINT={checkpoint}",
                           "DATA=synthetic"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith(".venv/bin/headbudget ")]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_calibrates_the_decider_once_before_it_serves(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")  # a trained checkpoint, as far as make can tell
    assert _planned(checkpoint) == ["decider", "serve"]  # the sweep and the benchmark come after
    (checkpoint / "decider.json").write_text("{}")
    later = time.time() + 5
    os.utime(checkpoint / "decider.json", (later, later))
    assert _planned(checkpoint) == ["serve"]  # not rebuilt while the checkpoint is unchanged
