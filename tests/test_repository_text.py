"""The repository speaks of the product: no text about how the work was organised, and nothing points outside
the repository but the data look-up (data is never committed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Work history and where the work ran are not the product's; the data folder beside a clone is.
FORBIDDEN = {
    "a numbered work period": re.compile(r"\bsessions? \d+", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? #?\d+\b", re.IGNORECASE),
    "a lent or borrowed machine": re.compile(r"\b(lent|borrowed) (GPU|machine)", re.IGNORECASE),
    "transfer limits": re.compile(r"\btransfer limits?\b", re.IGNORECASE),
    "a file outside the repository": re.compile(r"\.\./shared/(?!data\b)|shared/design|METHODS\.md"),
}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".cfg", ".txt", ".html", ".js", ".css", ".json"}
TEXT_NAMES = {"Makefile", "Dockerfile", ".dockerignore", ".gitignore", "run"}


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    paths = [ROOT / p for p in out.split("\0") if p]
    return [p for p in paths if p.is_file() and not p.is_symlink()
            and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES)]


def offences(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, rx in FORBIDDEN.items() for m in rx.finditer(text)]


def test_the_rules_catch_what_they_name() -> None:
    assert offences("as measured in session 21") and offences("issue 16's layer skipping")
    assert offences("a lent GPU brings back") and offences("see ../shared/design/METHODS.md")
    assert not offences("data from ../shared/data or $HEADBUDGET_DATA; a session cookie; issues are welcome")


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git work tree")
def test_no_tracked_text_names_the_work_history_or_outside_files() -> None:
    found = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {o}" for o in offences(text)]
    assert not found, "\n".join(found[:50]) + (f"\n... and {len(found) - 50} more" if len(found) > 50 else "")


# A module docstring says what the module is and does; its figures belong in docs/results.md, which the docstring
# may link. A measurement is a number with a unit of time, memory or speed-up, or a percentage; a line that defines
# a setting or a bound ("default 250 ms", "sampled every 5 ms", "plus 1 MiB") is not one.
MEASUREMENT = re.compile(
    r"(?<![\w.])\d+(?:[.,]\d+)*\s*(?:ms|us|µs|MB|MiB|GB|GiB|x faster|x slower|%)(?![\w])", re.IGNORECASE)
DEFINITION = re.compile(r"\b(default|target|every|plus|at most|at least|up to|cap|limit|e\.g\.|for example)\b",
                        re.IGNORECASE)


def module_docstring_measurements(source: str) -> list[str]:
    """Lines of a module's docstring that quote a measurement."""
    import ast

    doc = ast.get_docstring(ast.parse(source), clean=False) or ""
    return [line.strip() for line in doc.splitlines() if MEASUREMENT.search(line) and not DEFINITION.search(line)]


def test_the_docstring_rule_catches_a_benchmark_log() -> None:
    assert module_docstring_measurements('"""The backend.\n\nchain (removed): b=1 20.3 ms, b=0.5 11.2 ms."""')
    assert module_docstring_measurements('"""Serving.\n\nThis made it 2.4x faster and 38% cheaper."""') == [
        "This made it 2.4x faster and 38% cheaper."]
    assert not module_docstring_measurements('"""Admission.\n\nThe queue waits at most 5 ms (default 5 ms)."""')
    assert not module_docstring_measurements('"""Figures: docs/results.md, \'Server overhead\'."""')


def test_module_docstrings_hold_no_measurement_logs() -> None:
    found = []
    for path in sorted((ROOT / "headbudget").rglob("*.py")):
        found += [f"{path.relative_to(ROOT)}: {line}"
                  for line in module_docstring_measurements(path.read_text(encoding="utf-8"))]
    assert not found, "measurements belong in docs/results.md:\n" + "\n".join(found)
