"""lab/engine_outputs.py: two runs of the same code on one checkpoint compare equal; a changed output does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab.engine_outputs", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_same_code_compares_equal_and_a_changed_logit_does_not(tiny_model_scope_checkpoint: Path,
                                                                tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        r = _run(str(tiny_model_scope_checkpoint), str(out))
        assert r.returncode == 0, r.stderr
    same = _run("--compare", str(a), str(b))
    assert same.returncode == 0 and same.stdout.startswith("84/84 identical"), same.stdout + same.stderr
    doc = json.loads(b.read_text())
    doc["int8/0.5/6"]["preds"][0]["logits"][0] += 1e-7
    b.write_text(json.dumps(doc))
    changed = _run("--compare", str(a), str(b))
    assert changed.returncode == 1 and "83/84 identical" in changed.stdout and "int8/0.5/6" in changed.stdout
