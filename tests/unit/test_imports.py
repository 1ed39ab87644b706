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

import paths
import pytest

# One worker parses the tree once for all of them (each parse of every module is ~0.9 s of CPU).
pytestmark = [pytest.mark.xdist_group("imports")]

ROOT = paths.ROOT
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
    assert "isolator.transport.bridge" in edges["isolator.transport.server"]
    assert "isolator.core.context" in edges["isolator.core.prepare"]
    assert "volumes.inject" in edges["isolator.core.prepare"]


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
#   policy and the core's Protocols; transport serves both routes for the core's API (its settings
#   built by the daemon); bridge is the routes' client side and imports nothing of ours; the daemon
#   and the CLI compose everything; testing and simhost stand in for the machine.
VOCABULARY = {"isolator", "isolator.model", "isolator.errors", "isolator.crashpoints", "isolator.devicerule"}
MAY_IMPORT: dict[str, set[str]] = {
    "vocabulary": set(),
    "policy": {"policy"},
    "core": {"policy", "core", "volumes.inject", "volumes.errors"},
    "cgroups": {"policy", "core.ports", "cgroups"},
    "gpu": {"policy", "core.ports", "gpu"},
    "host": {"policy", "core.ports", "host"},
    # The socket guard holds the socket's lock file through the one pid-naming flock (host.pidlock).
    "transport": {"core.api", "rpc", "transport", "host.pidlock"},
    "bridge": {"bridge"},
    "exporters": {"policy", "core.api", "exporters"},
    "simhost": {"policy", "gpu", "simhost"},
    "rpc": {"rpc"},
    "volumes": {"volumes"},
}
# Each layer's height: a layer may import only from layers below it (and itself). The composition
# roots (daemon, cli, testing, __main__) stand above them all and are not in the table.
HEIGHT = {
    "vocabulary": 0,
    "rpc": 0,
    "volumes": 0,
    "bridge": 0,
    "policy": 1,
    "core": 2,
    "cgroups": 3,
    "gpu": 3,
    "host": 3,
    "transport": 4,
    "exporters": 3,
    "simhost": 4,
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


def layer_of_rule(rule: str) -> str:
    """The layer a MAY_IMPORT entry names (``core.api`` -> ``core``, ``volumes.inject`` -> ``volumes``)."""
    return rule.split(".")[0]


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


def both_ways(table: dict[str, set[str]]) -> list[str]:
    """Pairs of layers each allowed to import the other."""
    reach = {a: {layer_of_rule(r) for r in rules} - {a} for a, rules in table.items()}
    return sorted(f"{a} <-> {b}" for a, bs in reach.items() for b in bs if a < b and a in reach.get(b, set()))


def upward(table: dict[str, set[str]], height: dict[str, int]) -> list[str]:
    """Arrows the table allows from a layer to one at its height or above."""
    return sorted(
        f"{a} -> {r}"
        for a, rules in table.items()
        for r in rules
        if layer_of_rule(r) != a and height[layer_of_rule(r)] >= height[a]
    )


def test_the_layer_table_allows_no_layer_both_ways():
    assert both_ways(MAY_IMPORT) == []


def test_the_layer_table_has_no_arrow_from_a_lower_layer_to_a_higher_one():
    assert set(HEIGHT) == set(MAY_IMPORT)
    assert upward(MAY_IMPORT, HEIGHT) == []


def test_the_table_checks_catch_an_arrow_both_ways_and_an_upward_one():
    # 635ce0c's table: transport and bridge allowed each other, and transport reached up to daemon.config.
    table = {"transport": {"core.api", "bridge"}, "bridge": {"transport"}, "core": set(), "daemon": set()}
    assert both_ways(table) == ["bridge <-> transport"]
    assert upward({"transport": {"daemon.config"}, "daemon": set()}, {"transport": 3, "daemon": 5}) == [
        "transport -> daemon.config"
    ]
    assert upward({"core": {"policy"}, "policy": set()}, {"core": 2, "policy": 1}) == []


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
    "isolator.transport",
    "isolator.bridge",
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


def test_pynvml_has_one_home():
    # One home per outside dependency (STYLE.md): every NVML call goes through isolator.gpu.nvmlcall.
    known = modules()
    users = sorted(m for m, p in known.items() if any(n.split(".")[0] == "pynvml" for n in imports(p, m, known)))
    assert users == ["isolator.gpu.nvmlcall"]
