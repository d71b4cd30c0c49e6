"""The committed lock (requirements/): fresh against pyproject.toml, stale in one line when a requirement changes,
every requirement met by its pin, and the environment the suite runs in is exactly the lock."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {"main": ("serve", "torch", "train", "minilm", "loadtest", "dev"), "optimum": ("optimum",)}


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: str) -> dict[str, str]:
    text = (ROOT / "requirements" / f"{lock}.txt").read_text()
    return {_name(m.group(1)): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.MULTILINE)}


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "requirements" / "lock.py"), "check"], capture_output=True,
                          text=True, timeout=60)


def test_the_committed_locks_are_fresh() -> None:
    proc = check(ROOT)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr


def test_a_changed_requirement_stops_the_install_in_one_line(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    pyproject = (ROOT / "pyproject.toml").read_text()
    # A tool's setting is not a requirement: the locks stay fresh.
    (tmp_path / "pyproject.toml").write_text(pyproject.replace("line-length = 110", "line-length = 100"))
    assert check(tmp_path).returncode == 0
    # A requirement of the main lock's extras: only that lock is stale, named in one line with the way out.
    assert '"redis>=5",' in pyproject
    (tmp_path / "pyproject.toml").write_text(pyproject.replace('"redis>=5",', '"redis>=6",'))
    proc = check(tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "error: requirements/main.txt is stale against pyproject.toml (the project's environment (.venv)); "
        "run `make lock` to resolve again and test"]
    # The base dependencies are in the main lock too; the optimum lock follows its own extra.
    changed = pyproject.replace('"optimum-onnx[onnxruntime]>=0.1",', '"optimum-onnx[onnxruntime]>=0.2",')
    (tmp_path / "pyproject.toml").write_text(changed)
    assert [line.split()[1] for line in check(tmp_path).stderr.splitlines()] == ["requirements/optimum.txt"]


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_requirement_is_met_by_its_pin(lock: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = pins(lock)
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in LOCKS[lock] for r in project["optional-dependencies"][extra]]
    for req in wanted:
        name = _name(req.name)
        assert name in locked, f"{req} is not in requirements/{lock}.txt"
        version = locked[name].split("+")[0]  # torch's local label (+cpu) is the build, not the version
        assert req.specifier.contains(version, prereleases=True), f"{req}: locked {locked[name]}"
    assert locked["torch"].endswith("+cpu"), "the CPU build, never the registry's CUDA build"


def test_every_pin_has_hashes() -> None:
    for lock in LOCKS:
        text = (ROOT / "requirements" / f"{lock}.txt").read_text()
        entries = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 3)[3])
        assert entries and all("--hash=sha256:" in e for e in entries if e.strip()), lock


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="checks the environment `make install` builds (.venv)")
def test_the_environment_is_exactly_the_main_lock() -> None:
    installed = {_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    locked = pins("main")
    assert {n: v for n, v in installed.items() if locked.get(n) != v} == {
        n: installed[n] for n in ("headbudget", "pip") if n in installed}
    assert set(locked) <= set(installed)
