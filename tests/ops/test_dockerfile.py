"""Dockerfile and .dockerignore, checked without a Docker engine: the stages and what the final one contains,
that every COPY source reaches the build context, that the context holds an installable project, and that
the entry point's shell line hands the right arguments to `headbudget serve`."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.ops.live import serve_missing_reason
from tests.ops.promql import ROOT

DOCKERFILE = ROOT / "Dockerfile"
SERVE = ("serve --model /models/current --config /etc/headbudget/service.toml --host 0.0.0.0 --port 8000 "
         "--workers")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages() -> list[list[tuple[str, str]]]:
    """Instructions per build stage (before the first FROM: global ARGs, dropped)."""
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def dockerignore_patterns() -> list[tuple[bool, str]]:
    """(negated, pattern) in file order."""
    pats = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pats.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    return pats


def _matches(pattern: str, path: str) -> bool:
    """Docker's pattern match (Go filepath.Match plus **), also matching a parent folder of ``path``."""
    regex = "^" + re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*") \
        .replace(r"\?", "[^/]") + "(/.*)?$"
    return re.match(regex, path) is not None or fnmatch.fnmatch(path, pattern)


def in_context(path: str) -> bool:
    """Whether ``path`` (relative to the repository root) is sent to the Docker daemon; last match wins."""
    included = True
    for negated, pattern in dockerignore_patterns():
        if _matches(pattern, path):
            included = negated
    return included


def test_multi_stage_with_build_tools_only_in_the_build_stage() -> None:
    build, runtime = stages()
    assert re.match(r"\$\{PYTHON_IMAGE\} AS build$", build[0][1]) and runtime[0][1].endswith("AS runtime")
    build_runs = " ".join(a for i, a in build if i == "RUN")
    assert "build-essential" in build_runs
    assert "--index-url https://download.pytorch.org/whl/cpu" in build_runs
    runtime_runs = " ".join(a for i, a in runtime if i == "RUN")
    for tool in ("build-essential", "gcc", "g++", "make ", "apt-get install", "pip install"):
        assert tool not in runtime_runs, f"final stage installs {tool!r}"
    assert ("COPY", "--from=build /opt/venv /opt/venv") in runtime


def test_dependencies_come_from_the_projects_lock() -> None:
    """The image installs what `make install` installs: the lock as constraints with its hashes, and torch as the
    CPU wheel of the lock's version (no resolution of its own, no CUDA build)."""
    build = stages()[0]
    assert ("COPY", "requirements/main.txt /src/requirements/main.txt") in build
    run = next(a for i, a in build if i == "RUN" and "uv pip install" in a)
    assert "-c /src/requirements/main.txt --verify-hashes --find-links /tmp/wheels" in run
    download = run.index("pip download --no-deps -d /tmp/wheels")
    assert download < run.index("uv pip install") and "grep -o '^torch==[^ ]*' /src/requirements/main.txt" in run
    lock = (ROOT / "requirements" / "main.txt").read_text()
    for pin in ("uv", "torch"):  # what the greps find in the real lock
        assert re.search(rf"^{pin}==\S+ \\$", lock, re.MULTILINE), pin
    assert re.search(r"^torch==\S+\+cpu ", lock, re.MULTILINE)


def test_runtime_stage_is_non_root_with_healthcheck_and_entrypoint() -> None:
    runtime = stages()[1]
    users = [a for i, a in runtime if i == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert re.fullmatch(r"\d+:\d+", users[-1]), "numeric USER lets Kubernetes verify runAsNonRoot"
    health = next(a for i, a in runtime if i == "HEALTHCHECK")
    assert "http://127.0.0.1:8000/readyz" in health and "--interval=" in health and "--start-period=" in health
    entry = next(a for i, a in runtime if i == "ENTRYPOINT")
    assert f'exec headbudget {SERVE} \\"${{WORKERS}}\\"' in entry
    env = " ".join(a for i, a in runtime if i == "ENV")
    assert re.search(r"\bWORKERS=\d+", env) and "HF_HUB_OFFLINE=1" in env and "OMP_NUM_THREADS=1" in env
    assert ("EXPOSE", "8000") in runtime


def test_model_is_baked_from_the_build_argument_or_mounted() -> None:
    runtime = stages()[1]
    arg = next(a for i, a in runtime if i == "ARG" and a.startswith("MODEL_DIR"))
    default = arg.split("=", 1)[1]
    assert (ROOT / default).is_dir() and in_context(default + "/README.md")
    copy = next(a for i, a in runtime if i == "COPY" and "${MODEL_DIR}" in a)
    assert copy.endswith("${MODEL_DIR}/ /models/current/") and "--chown=10001:10001" in copy
    assert in_context("checkpoints/ag_news-quick/model.safetensors")
    assert in_context("checkpoints/ag_news-quick/config.json")
    assert not in_context("checkpoints/ag_news-quick/stages/dense/model.safetensors")
    assert not in_context("checkpoints/ag_news-quick/onnx/abc/b050.onnx")


def test_every_copy_source_is_in_the_build_context() -> None:
    for stage in stages():
        for ins, args in stage:
            if ins != "COPY" or "--from=" in args:
                continue
            *sources, _dest = [w for w in args.split() if not w.startswith("--")]
            for src in sources:
                if "${" in src:
                    continue
                assert (ROOT / src).exists(), f"COPY {src}: missing"
                assert in_context(src), f"COPY {src}: excluded by .dockerignore"


def test_context_leaves_out_what_the_image_does_not_need() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "runs/x/log.txt", "docs/results.md",
                 "headbudget/models/__pycache__/config.cpython-311.pyc",
                 "headbudget/loadtest/reports/r1/report.html"):
        assert not in_context(path), path
    for path in ("pyproject.toml", "README.md", "headbudget/models/config.py", "headbudget/service/metrics.py",
                 "headbudget/experiments/bench.py", "headbudget/loadtest/mix.py"):
        assert in_context(path), path


def test_dependency_layer_command_reads_pyproject() -> None:
    """The RUN line that lists dependencies from pyproject.toml works on the real file."""
    run = next(a for i, a in stages()[0] if i == "RUN" and "tomllib" in a)
    code = shlex.split(run.split("python -c", 1)[1])[0].replace("/src/pyproject.toml", str(ROOT / "pyproject.toml"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "torch==2.13.0" in out and any(d.startswith("fastapi") for d in out)


def test_build_context_holds_an_installable_project(tmp_path: Path) -> None:
    """Copy what .dockerignore lets through and build the wheel the image installs (no dependencies)."""
    ctx = tmp_path / "ctx"
    for ins, args in stages()[0]:
        if ins != "COPY":
            continue
        src = args.split()[0]
        for path in [ROOT / src] if (ROOT / src).is_file() else sorted((ROOT / src).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if path.is_file() and in_context(rel):
                (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, ctx / rel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(ctx)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("headbudget-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("headbudget/cli.py", "headbudget/commands/common.py", "headbudget/models/config.py",
                   "headbudget/engine/protocol.py", "headbudget/service/settings.py",
                   "headbudget/loadtest/locustfile.py", "headbudget/training/data.py"):
        assert module in names, f"{module} missing from the image's wheel"
    if (ROOT / "headbudget" / "commands" / "serve.py").is_file():
        assert "headbudget/commands/serve.py" in names


def test_entrypoint_passes_workers_and_extra_arguments(tmp_path: Path) -> None:
    """Run the entry point's shell line with a stand-in `headbudget` that prints its arguments."""
    entry = next(a for i, a in stages()[1] if i == "ENTRYPOINT")
    argv = __import__("json").loads(entry)
    fake = tmp_path / "headbudget"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    sh = shutil.which(argv[0]) or pytest.skip(f"{argv[0]} not found")
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "WORKERS": "3"}
    out = subprocess.run([sh, *argv[1:], "--backend", "torch"], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == [*SERVE.split(), "3", "--backend", "torch"]


def test_entrypoint_arguments_are_accepted_by_the_real_cli(tmp_path: Path) -> None:
    """The flags the image passes exist in `headbudget serve` and parse (model folder swapped for a real one)."""
    from headbudget.cli import build_parser

    if serve_missing_reason():
        pytest.skip(serve_missing_reason())
    try:
        parser = build_parser()
        argv = [w.replace("/models/current", str(tmp_path)) for w in SERVE.split()] + ["2"]
        args = parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`headbudget {' '.join(SERVE.split())} 2` is refused by the CLI (exit {e.code})")
    assert args.command == "serve" and (args.host, args.port, args.workers) == ("0.0.0.0", 8000, 2)
    assert str(args.config) == "/etc/headbudget/service.toml"
