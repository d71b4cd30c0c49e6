"""The service's modules import each other in one direction: no import circle among them.

grimp reads every import statement, those inside functions and under TYPE_CHECKING included, so a lazy import
that closes a circle counts as one.
"""

from __future__ import annotations

import grimp

from tests.headbudget.test_imports import circles

SERVICE = "headbudget.service"


def _service_graph() -> dict[str, set[str]]:
    """Each service module and the service modules it imports."""
    graph = grimp.build_graph("headbudget")
    modules = {m for m in graph.modules if m == SERVICE or m.startswith(SERVICE + ".")}
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def test_no_import_circle_in_service() -> None:
    edges = _service_graph()
    assert f"{SERVICE}.scheduling.batching" in edges and f"{SERVICE}.http.routes.classify" in edges  # the graph is the package's
    assert circles(edges) == []
