"""The import graph of isolator/ and volumes/, built from the source with ast: no cycles, and a core
that reaches the machine only through its ports.

Every import counts, including those under ``if TYPE_CHECKING:`` and inside functions: a cycle
hidden in either is still two modules that cannot be understood one without the other.
"""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Iterator

import pytest

# One worker parses the tree once for all of them (each parse of every module is ~0.9 s of CPU).
pytestmark = [pytest.mark.xdist_group("imports")]

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


@functools.cache
def _named(path: str, module: str) -> tuple[tuple[str, str], ...]:
    """Each import statement's names in ``path``: (the name as a module, the module it is from)."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    is_package = path.endswith("__init__.py")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            for alias in node.names:
                out.append((f"{base}.{alias.name}", base))
    return tuple(out)


def imports(path: str, module: str, known: dict[str, str]) -> Iterator[str]:
    for full, base in _named(path, module):
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


# ---- The layers ---------------------------------------------------------------------------------
# Each layer is a package; what it may import from the project is written here once (docs/architecture.md
# draws the same picture). The vocabulary is isolator/__init__, model, errors, crashpoints and devicerule.
#
#   policy and the core decide; they import only the vocabulary (the core also policy and the volume
#   package's pure decision, volumes.inject); the edges (cgroups, gpu, host) import the vocabulary,
#   policy and the core's Protocols; transport and bridge translate for the core's API; the daemon
#   and the CLI compose everything; testing and simhost stand in for the machine.
VOCABULARY = {"isolator", "isolator.model", "isolator.errors", "isolator.crashpoints", "isolator.devicerule"}
MAY_IMPORT: dict[str, set[str]] = {
    "vocabulary": set(),
    "policy": {"policy"},
    "core": {"policy", "core", "volumes.inject", "volumes.errors"},
    "cgroups": {"policy", "core.ports", "cgroups"},
    "gpu": {"policy", "core.ports", "gpu"},
    "host": {"policy", "core.ports", "host"},
    # The server reads its settings from the daemon's Config, a plain dataclass; its socket guard
    # holds the socket's lock file through the one pid-naming flock (host.pidlock, stdlib only).
    "transport": {"core.api", "rpc", "transport", "bridge", "daemon.config", "host.pidlock"},
    "bridge": {"rpc", "transport", "bridge"},
    "exporters": {"policy", "core.api", "exporters"},
    "simhost": {"policy", "gpu", "simhost"},
    "rpc": {"rpc"},
    "volumes": {"volumes"},
}
# Below these layers nothing may reach the machine, all the way down through the project's imports.
PURE_LAYERS = ("vocabulary", "policy", "core")
MACHINE = {
    "os",
    "subprocess",
    "signal",
    "socket",
    "sqlite3",
    "ctypes",
    "fcntl",
    "select",
    "shutil",
    "grpc",
    "pynvml",
    "google",
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if module in VOCABULARY:
        return "vocabulary"
    if parts[0] == "volumes":
        return "volumes"
    return parts[1]


def allowed(importer: str, imported: str) -> bool:
    if imported in VOCABULARY:
        return True
    rules = MAY_IMPORT.get(layer_of(importer))
    if rules is None:  # daemon, cli, testing, the package's __main__: the composition roots
        return True
    names = {imported.split(".", 1)[1] if imported.startswith("isolator.") else imported}
    name = names.pop()
    return any(name == r or name.startswith(r + ".") for r in rules)


def test_every_module_imports_only_what_its_layer_may():
    bad = sorted(f"{m} -> {i}" for m, edges in graph().items() for i in edges if not allowed(m, i))
    assert bad == []


def test_the_layer_rule_refuses_a_core_module_that_imports_an_edge():
    assert not allowed("isolator.core.hooks", "isolator.host.state")
    assert not allowed("isolator.policy.allocator", "isolator.core.context")
    assert not allowed("isolator.gpu.nvml", "isolator.daemon.config")
    assert allowed("isolator.cgroups.v1", "isolator.core.ports") and allowed(
        "isolator.daemon.main", "isolator.gpu.nvml"
    )


def closure(start: set[str], edges: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges[module])
    return seen


def test_nothing_below_the_edges_reaches_the_machine_however_deep_the_imports_go():
    known, edges = modules(), graph()
    start = {m for m in known if layer_of(m) in PURE_LAYERS}
    reached = []
    for module in sorted(closure(start, edges)):
        for name in imports(known[module], module, known):
            top = name.split(".")[0]
            if name not in known and top in MACHINE:
                reached.append(f"{module} imports {name}")
    assert reached == []


def test_the_deep_check_follows_a_chain():
    edges = {"a": {"b"}, "b": {"c"}, "c": set(), "d": set()}
    assert closure({"a"}, edges) == {"a", "b", "c"}


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
