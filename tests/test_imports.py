"""The import graph of isolator/ and volumes/, built from the source with ast: no cycles, and a core
that reaches the machine only through its ports.

Every import counts, including those under ``if TYPE_CHECKING:`` and inside functions: a cycle
hidden in either is still two modules that cannot be understood one without the other.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("isolator", "volumes")


def modules() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        for directory, _dirs, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


def imports(path: str, module: str, known: dict[str, str]) -> Iterator[str]:
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    is_package = path.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in known else base


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {i for i in imports(p, m, known) if i in known and i != m} for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_known_edges():
    edges = graph()
    assert "isolator.bridge.listener" in edges["isolator.transport.server"]
    assert "isolator.core.context" in edges["isolator.core.hooks"]
    assert "volumes.inject" in edges["isolator.core.hooks"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_in_isolator_or_volumes():
    assert cycles(graph()) == []


# The core reaches the machine only through its ports (isolator/core/ports.py): no os, no
# subprocess, no sockets, no grpc or generated code, no concrete edge module.
FORBIDDEN_IN_CORE = {
    "os",
    "subprocess",
    "socket",
    "sqlite3",
    "ctypes",
    "grpc",
    "isolator.rpc",
    "isolator.transport.server",
    "isolator.bridge.listener",
    "isolator.cgroups",
    "isolator.gpu.nvml",
    "isolator.host.state",
    "isolator.host.system",
    "isolator.host.rootfs",
    "isolator.simhost",
    "isolator.daemon.main",
    "volumes.manager",
    "volumes.build",
}


def test_the_core_imports_no_edge():
    known = modules()
    for module, path in known.items():
        if not module.startswith("isolator.core"):
            continue
        for name in imports(path, module, known):
            bad = [f for f in FORBIDDEN_IN_CORE if name == f or name.startswith(f + ".")]
            assert not bad, f"{module} imports {name}"
