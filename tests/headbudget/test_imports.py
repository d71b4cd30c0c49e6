"""The package's modules import each other in one direction: no import circle anywhere in ``headbudget``.

The graph is read with ``ast`` from every import statement of every module, those inside functions included: a
lazy import that closes a circle still ties the two modules together, and only the order of first use keeps it
from failing at start-up. Imports under ``if TYPE_CHECKING:`` are left out: they never run, and a type that two
modules name in each other's annotations is not a dependency between them. A module named at run time
(``importlib.import_module``, how the CLI finds its commands) is not read.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import headbudget

PACKAGE = "headbudget"
SOURCE = Path(headbudget.__file__).resolve().parent  # the package folder


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` (the folder that holds it) by dotted name."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements anywhere in ``tree`` except in the body of an ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif _type_checking_only(node):
            assert isinstance(node, ast.If)
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    """The package's modules that ``node``, in ``module``, imports: the named module, or for ``from X import y``
    the submodule X.y where there is one, else X (a name defined in X)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            anchor = ".".join(package[: len(package) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    out = set()
    for name in names:
        while name and name not in modules:  # `import a.b.c` of a name in a.b: the longest known prefix
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package under ``root`` and the package's modules it imports."""
    paths = _modules(root)
    modules = set(paths)
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = set().union(*(_imported(module, path.name == "__init__.py", node, modules)
                                       for node in _statements(tree)))
    return graph


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(edges[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1 or module in edges[module]:
                found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def test_circles_are_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(circles(edges)) == [["a", "b", "c"], ["e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "c", "d", "e", "sub/__init__", "sub/f"):
        (pkg / f"{name}.py").touch()
    (pkg / "a.py").write_text("import headbudget.b\nfrom headbudget.sub import f\nfrom . import c\n"
                              "def later():\n    from .d import name\n")
    (pkg / "sub" / "f.py").write_text("from ..e import name\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from headbudget import a\n")
    graph = import_graph(tmp_path)
    assert graph["headbudget.a"] == {"headbudget.b", "headbudget.sub.f", "headbudget.c", "headbudget.d"}
    assert graph["headbudget.sub.f"] == {"headbudget.e"}  # the TYPE_CHECKING import is left out


def test_a_planted_circle_is_reported(tmp_path: Path) -> None:
    shutil.copytree(SOURCE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    assert circles(import_graph(tmp_path)) == []
    engine = tmp_path / PACKAGE / "engine"
    with open(engine / "names.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _planted() -> None:\n    from headbudget.engine import errors  # noqa: F401\n")
    with open(engine / "errors.py", "a", encoding="utf-8") as f:
        f.write("\n\nfrom headbudget.engine.names import Backend  # noqa: E402, F401\n")
    assert circles(import_graph(tmp_path)) == [["headbudget.engine.errors", "headbudget.engine.names"]]


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph(SOURCE.parent)
    assert "headbudget.service.scheduling.batching" in graph and "headbudget.engine.factory" in graph  # the real package
    assert circles(graph) == []
