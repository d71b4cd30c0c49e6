"""The service's modules import each other in one direction: no import circle among them.

grimp reads every import statement, those inside functions and under TYPE_CHECKING included, so a lazy import
that closes a circle counts as one.
"""

from __future__ import annotations

import grimp

SERVICE = "headbudget.service"


def _service_graph() -> dict[str, set[str]]:
    """Each service module and the service modules it imports."""
    graph = grimp.build_graph("headbudget")
    modules = {m for m in graph.modules if m == SERVICE or m.startswith(SERVICE + ".")}
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
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
    assert sorted(_circles(edges)) == [["a", "b", "c"], ["e"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_service() -> None:
    edges = _service_graph()
    assert f"{SERVICE}.batching" in edges and f"{SERVICE}.routes.classify" in edges  # the graph is the package's
    assert _circles(edges) == []
