"""Which CPUs and memory nodes a container runs on, from its GPUs' locality: pure, no I/O.

``decide`` takes the GPUs' CPU affinity and NUMA node (as NVML reports them, ``nvidia-smi topo -m``
columns "CPU Affinity" and "NUMA Affinity") and what this machine really has online (read by the
cpuset edge, isolator/cgroups/cpuset.py), and returns the set to enforce or to hint. It never
widens an empty answer to "every CPU": that is ``AffinityEmpty``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from isolator.errors import AffinityEmpty, AffinityUnknown, InvalidArgument

MODES = ("off", "hint", "enforce")
MAX_CPUS = 1 << 16  # far above any machine; bounds a hostile or corrupt list

# The environment a container is given in ``hint`` and ``enforce`` modes (docs/affinity.md).
ENV_CPUS = "GPU_ISOLATOR_CPUS"
ENV_NUMA_NODES = "GPU_ISOLATOR_NUMA_NODES"


def parse_list(text: str) -> frozenset[int]:
    """``0-19,40-59`` (sysfs cpulist syntax, also cpuset.cpus/cpuset.mems) -> the numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InvalidArgument(f"{text!r} is not a CPU or node list (expected e.g. 0-19,40-59)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first or last >= MAX_CPUS:
            raise InvalidArgument(f"{part!r} in {text!r} is not a valid range")
        out.update(range(first, last + 1))
    return frozenset(out)


def format_list(numbers: Iterable[int]) -> str:
    """The numbers in sysfs cpulist syntax, ranges collapsed: ``{0,1,2,5}`` -> ``0-2,5``."""
    items = sorted(set(numbers))
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True)
class Machine:
    """What this machine really has: online CPUs, memory nodes, and each node's CPUs."""

    cpus: frozenset[int]
    mems: frozenset[int]
    node_cpus: Mapping[int, frozenset[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuLocality:
    """One GPU's place: its minor (to name it), NUMA node (None: unknown) and local CPUs ('' unknown)."""

    minor: int
    numa_node: int | None
    cpu_affinity: str


@dataclass(frozen=True)
class Affinity:
    """The CPUs and memory nodes local to a container's GPUs, on this machine."""

    cpus: frozenset[int]
    mems: frozenset[int]

    @property
    def cpu_list(self) -> str:
        return format_list(self.cpus)

    @property
    def mem_list(self) -> str:
        return format_list(self.mems)

    def environment(self) -> tuple[tuple[str, str], ...]:
        return ((ENV_CPUS, self.cpu_list), (ENV_NUMA_NODES, self.mem_list))


def decide(gpus: Iterable[GpuLocality], machine: Machine) -> Affinity | None:
    """The union of the GPUs' local CPUs and memory nodes, intersected with the machine's.

    None for a container without GPUs (it is left alone). CPUs: the union of the GPUs' affinity
    lists, intersected with the online CPUs; nothing left is ``AffinityEmpty``, never "all CPUs".
    Memory nodes: the GPUs' NUMA nodes that are memory nodes here; when none is (a GPU on a node
    without memory, or a simulated node this machine does not have), the memory nodes holding the
    chosen CPUs, so that memory stays next to the threads; nothing left is ``AffinityEmpty``.
    A GPU whose CPU affinity is unknown is ``AffinityUnknown``: its locality cannot be honoured.
    """
    gpus = sorted(gpus, key=lambda g: g.minor)
    if not gpus:
        return None
    unknown = [g.minor for g in gpus if not g.cpu_affinity.strip()]
    if unknown:
        raise AffinityUnknown(gpus=unknown)
    local: set[int] = set()
    for g in gpus:
        local |= parse_list(g.cpu_affinity)
    cpus = frozenset(local) & machine.cpus
    minors = [g.minor for g in gpus]
    if not cpus:
        raise AffinityEmpty(
            gpus=minors,
            what="CPUs",
            local=format_list(local),
            machine=format_list(machine.cpus),
        )
    nodes = {g.numa_node for g in gpus if g.numa_node is not None}
    mems = frozenset(nodes) & machine.mems
    if not mems:
        mems = frozenset(n for n, node_cpus in machine.node_cpus.items() if node_cpus & cpus) & machine.mems
    if not mems:
        raise AffinityEmpty(
            gpus=minors,
            what="memory nodes",
            local=format_list(nodes) or "unknown",
            machine=format_list(machine.mems),
        )
    return Affinity(cpus=cpus, mems=mems)


def narrowed(before: frozenset[int], after: frozenset[int]) -> frozenset[int]:
    """The CPUs (or nodes) a container could use before and no longer can: what the log must name."""
    return before - after
