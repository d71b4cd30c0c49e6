"""Every file the documentation names exists in the repository: links and backticked paths in README.md and docs/."""
from __future__ import annotations

import re
from itertools import product
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...
EXTENSIONS = (".py", ".md", ".json", ".toml", ".yml", ".yaml", ".png", ".sh", ".txt", ".cfg", ".ini", ".html",
              ".js", ".css", ".csv", ".onnx")
# Not files of the repository, so not checked: URLs and bare #anchors; absolute paths and HTTP routes ("/...",
# "~/..."); the data folders, never committed (../shared/data, $HEADBUDGET_DATA); what commands write at run time
# (checkpoints/, runs/, $OUT/, .venv/, dist/, build/); patterns with a placeholder (`engine/<name>_backend.py`, `*`);
# bare file names without a folder (`sweep.json` names a kind of file, not one file); and fenced code blocks, whose
# paths are a command's inputs and outputs.
SKIPPED_PREFIXES = ("../shared/data", "$HEADBUDGET_DATA", "checkpoints/", "runs/", "logs/", "$OUT", ".venv/", "dist/",
                    "build/", "/", "~")


def _expand_braces(path: str) -> list[str]:
    """`docs/results/{a,b}/x.json` names two files."""
    parts = re.split(r"\{([^{}]*)\}", path)
    if len(parts) == 1:
        return [path]
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in product(*choices)]


def _code_span_path(span: str) -> str | None:
    """The repository path a code span names, if it names one (`engine/weights/pack.py::f` names engine/weights/pack.py)."""
    token = span.strip().split()[0] if span.strip() else ""
    token = re.sub(r"(::.*|:\d.*|:)$", "", token)
    if "/" not in token or token.startswith(SKIPPED_PREFIXES) or URL.match(token) or re.search(r"[<>*]", token):
        return None
    first = token.split("/")[0]
    if (ROOT / first).exists() or first in (".", "..") or token.endswith(EXTENSIONS):
        return token
    return None  # "fp32/int8", "application/json": words with a slash, not paths


def named_paths(markdown: str) -> list[tuple[str, str]]:
    """(kind, path) for every link target and backticked repository path outside fenced code blocks."""
    text = FENCE.sub("", markdown)
    found: list[tuple[str, str]] = []
    for target in LINK.findall(text):
        if URL.match(target) or target.startswith("#") or target.startswith(SKIPPED_PREFIXES):
            continue
        found += [("link", p) for p in _expand_braces(target.split("#")[0])]
    for span in CODE_SPAN.findall(text):
        path = _code_span_path(span)
        if path is not None:
            found += [("code", p) for p in _expand_braces(path)]
    return found


def missing_paths(markdown: str, where: Path) -> list[str]:
    """Named paths that are not in the repository: links resolve from the document's folder, code spans from the
    repository root or the document's folder; anything that resolves outside the repository counts as missing."""
    missing = []
    for kind, path in named_paths(markdown):
        bases = [where.parent] if kind == "link" else [ROOT, where.parent]
        hits = [(base / path).resolve() for base in bases]
        if not any(h.exists() and h.is_relative_to(ROOT) for h in hits):
            missing.append(f"{kind}: {path}")
    return missing


def test_extractor_finds_links_and_repository_paths_and_skips_the_rest():
    md = """See [the method](method.md#gates), ![plot](results/x/pareto.png) and [site](https://example.org/a.md).
Code: `engine/weights/pack.py::w1_by_rows`, `models/plan.py: exit_sequence`, `docs/results/{a,b}/auto.json`.
Skipped: `../shared/data/ag_news`, `checkpoints/quick/sweep.json`, `/v1/classify`, `fp32/int8`, `sweep.json`,
`$OUT/bench.json`, `engine/<name>_backend.py`, [anchor](#top).
```
headbudget bench --out docs/results/inside/a/fence.json
```
"""
    assert named_paths(md) == [
        ("link", "method.md"), ("link", "results/x/pareto.png"),
        ("code", "engine/weights/pack.py"), ("code", "models/plan.py"),
        ("code", "docs/results/a/auto.json"), ("code", "docs/results/b/auto.json"),
    ]


def test_a_made_up_path_is_reported_missing_and_a_real_one_is_not():
    where = ROOT / "docs" / "results.md"
    md = ("`engine/no_such_module.py`, [gone](results/no/such/file.json), [outside](../../outside.md), "
          "`tests/test_docs.py`, [here](results.md)")
    assert missing_paths(md, where) == [
        "link: results/no/such/file.json", "link: ../../outside.md", "code: engine/no_such_module.py"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_file_exists(doc: Path):
    missing = missing_paths(doc.read_text(encoding="utf-8"), doc)
    assert not missing, f"{doc.relative_to(ROOT)} names files that are not in the repository: {missing}"
